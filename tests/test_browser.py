"""Chapter 02's capacity explorer, driven in a real browser: JupyterLab in headless Chromium.

The test starts JupyterLab on 127.0.0.1 with a random token and port, opens a copy
of chapters/02_cost_per_token.ipynb, runs all cells, moves the "device memory"
slider with the keyboard as a reader would, and checks that the displayed number
of sequences that fit becomes what labkit.memory.capacity computes for the new setting.
It also checks that JupyterLab did not greet the reader with its "Jupyter news"
question: the repository's settings (installed by `make setup`) turn it off, and
the test leaves JupyterLab's own settings alone.
It saves a screenshot, capacity_explorer.png, in pytest's tmp_path for the test.

Chromium comes from Debian (`apt-get install chromium`), driven by the Python
playwright package through ``executable_path``: `playwright install` cannot
download browsers here. All Jupyter, IPython, matplotlib and Chromium state lives
in the test's temporary folder, never in the home folder.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from labkit.memory import capacity
from labkit.teaching.widgets.capacity_explorer import KV_DTYPES, PLAIN_BYTES
from labkit.units import GiB

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "chapters" / "02_cost_per_token.ipynb"
CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=(
        f"Chromium not found at {CHROMIUM}: install it with `apt-get install chromium` "
        "(Debian/Ubuntu; `playwright install` cannot download browsers here)")),
]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(state: Path) -> dict[str, str]:
    """Environment variables that keep every piece of state under ``state``."""
    env = dict(os.environ)
    for var in ["JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR",
                "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HOME"]:
        path = state / var.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    # Nothing here silences the "Jupyter news" question: the repository's own settings must
    # (jupyterlab-settings/kv-cache-labs.json5, installed by `make setup`), and the test checks it.
    # Start the notebook's kernel without asking (a "Select Kernel" dialog shows up now and then
    # otherwise), and never autosave.
    settings = state / "jupyter_config_dir" / "lab" / "user-settings" / "@jupyterlab"
    for plugin, values in [("notebook-extension/tracker", {"autoStartDefaultKernel": True}),
                           ("docmanager-extension/plugin", {"autosave": False})]:
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return env


@pytest.fixture
def jupyter_lab(tmp_path):
    """A JupyterLab server over a copy of the chapter; yields (base url, token)."""
    root = tmp_path / "book"
    (root / "chapters").mkdir(parents=True)
    shutil.copy(NOTEBOOK, root / "chapters" / NOTEBOOK.name)  # autosave must not touch the committed notebook
    port, token = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "jupyter.log", "w")
    server = subprocess.Popen(cmd, env=isolated_env(tmp_path / "state"), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            if server.poll() is not None:
                pytest.fail(f"jupyter lab exited with {server.returncode}:\n{(tmp_path / 'jupyter.log').read_text()}")
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"jupyter lab did not answer in 90 s:\n{(tmp_path / 'jupyter.log').read_text()}")
                time.sleep(0.5)
        yield url, token
    finally:
        server.send_signal(signal.SIGTERM)  # the server shuts its kernels down
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # only the group this fixture started
            server.wait()
        log.close()


def slider(page, label: str):
    """The ipywidgets slider whose description is ``label``."""
    exact = re.compile(rf"^{re.escape(label)}$")
    return page.locator(".widget-hslider", has=page.locator(".widget-label", has_text=exact))


def readout_number(page, label: str) -> float:
    """The number a slider's readout shows. text_content, not inner_text: JupyterLab skips rendering
    cells that are out of view (CSS content-visibility), and inner_text is empty for those."""
    return float(slider(page, label).locator(".widget-readout").text_content().strip().replace(",", ""))


def test_capacity_explorer_in_chromium(jupyter_lab, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    url, token = jupyter_lab

    with sync_api.sync_playwright() as pw:
        # Playwright gives Chromium a fresh profile in a temporary folder; HOME and XDG_* point
        # into tmp_path so that nothing else lands in the home folder either.
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                     env=isolated_env(tmp_path / "state"))
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        try:
            page.set_default_timeout(60_000)
            page.goto(f"{url}/lab/tree/chapters/{NOTEBOOK.name}?token={token}")
            page.wait_for_selector(".jp-NotebookPanel")
            select_kernel = page.locator(".jp-Dialog .jp-mod-accept", has_text="Select")
            try:  # should the kernel dialog still appear, answer it as a reader would
                select_kernel.click(timeout=5_000)
            except sync_api.TimeoutError:
                pass
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")

            # Run > Run All Cells, as a reader would.
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            # Generous waits: on a busy 2-core machine the whole chapter can take a minute or more.
            fit = page.locator(".capacity-readout .capacity-fit")
            fit.wait_for(timeout=240_000)
            # Every cell has run when the last one has an execution count and the kernel is idle.
            page.wait_for_function(
                """() => { const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
                           return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent)); }""",
                polling=500, timeout=240_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            assert errors.count() == 0, errors.first.inner_text()
            # JupyterLab asks its news question as soon as the app is restored, long before the cells
            # have run, unless the repository's settings (`make setup`) answer it.
            news = page.get_by_text("Would you like to get notified about official Jupyter news?")
            assert news.count() == 0, ("JupyterLab asked its 'Jupyter news' question: install the repository's "
                                       "settings with `make setup` (jupyterlab-settings/kv-cache-labs.json5)")

            def expected_fit() -> int:
                """What labkit.memory.capacity says for the setting the controls show now."""
                menu = page.locator(".widget-dropdown", has=page.locator(".widget-label", has_text="KV cache dtype"))
                kv = dict(KV_DTYPES)[menu.locator("select").input_value()]  # the option shown: its label
                shape = capacity.ModelShape("x", int(readout_number(page, "layers")),
                                            int(readout_number(page, "KV heads")),
                                            int(readout_number(page, "head dim")), PLAIN_BYTES.get(kv, 2))
                per_request = capacity.kv_cache_bytes(shape, int(readout_number(page, "context length (tokens)")),
                                                      "auto" if kv in PLAIN_BYTES else kv)
                return capacity.sequences_that_fit(per_request, readout_number(page, "device memory (GiB)") * GiB,
                                                   readout_number(page, "set aside (GiB)") * GiB)

            page.locator(".capacity-explorer").scroll_into_view_if_needed()  # as a reader would, before reading
            before = expected_fit()
            assert before == 7  # the default setting is the article's 24 GiB device with 17 GiB set aside
            sync_api.expect(fit).to_have_text(f"{before:,}")

            # Move "device memory" one step right with the keyboard: 24 -> 25 GiB.
            device = slider(page, "device memory (GiB)")
            device.scroll_into_view_if_needed()
            old_device = readout_number(page, "device memory (GiB)")
            handle = device.locator(".noUi-handle")
            handle.focus()
            handle.press("ArrowRight")
            sync_api.expect(device.locator(".widget-readout")).not_to_have_text(f"{old_device:g}")
            after = expected_fit()
            assert readout_number(page, "device memory (GiB)") > old_device
            assert after != before, "the step should change the capacity"
            sync_api.expect(fit).to_have_text(f"{after:,}")
            page.locator(".capacity-explorer").scroll_into_view_if_needed()
            page.wait_for_timeout(500)  # let the plot redraw before the picture
            shot = tmp_path / "capacity_explorer.png"
            page.screenshot(path=str(shot))
            print(f"screenshot: {shot}")
            assert shot.stat().st_size > 10_000
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"))  # what the page showed when it failed
            print(f"failure screenshot: {tmp_path / 'failure.png'}")
            raise
        finally:
            browser.close()
