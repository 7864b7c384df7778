"""labkit.teaching.diagrams draws what the run counted: one box per prompt token, one cell per layer and position."""

import matplotlib

matplotlib.use("Agg")

from matplotlib.patches import Rectangle  # noqa: E402

from labkit.teaching.diagrams import DECODE_COLOUR, PREFILL_COLOUR, prefill_decode_diagram  # noqa: E402


def test_the_cache_has_a_cell_per_layer_and_position():
    from matplotlib.colors import to_rgba

    fig = prefill_decode_diagram([5, 6, 7], [8, 9], num_layers=3)
    boxes = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    filled = lambda colour: sum(1 for b in boxes if b.get_facecolor()[:3] == to_rgba(colour)[:3])  # noqa: E731
    # the legend adds one swatch of each colour
    assert filled(PREFILL_COLOUR) == 3 * 3 + 1 and filled(DECODE_COLOUR) == 3 * 2 + 1
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "prompt: 3 tokens" in texts and any("2 steps" in t for t in texts)
    assert any("3 layers × 5 positions" in t for t in texts)


def test_the_roadmap_lights_exactly_the_chapters_parts():
    import matplotlib.pyplot as plt
    import pytest
    from matplotlib.colors import to_rgba

    from labkit.teaching.diagrams import (DRAWN_FROM, HIGHLIGHT_COLOUR, ROADMAP_CHAPTERS, ROADMAP_PARTS, book_part,
                                          roadmap)

    assert {f"0{i}" for i in range(1, 9)} | {f"A{i}" for i in range(1, 8)} | {"C1"} == set(ROADMAP_CHAPTERS)
    for chapter, (name, parts) in ROADMAP_CHAPTERS.items():
        fig = roadmap(chapter)
        boxes = {p.get_gid(): p for p in fig.axes[0].patches if p.get_gid()}
        # Part I and its appendices stay inside the article's one server; Part II draws the router in front
        # (from 07), and the second tier and the decode pool (from 08)
        beyond = {p for p, first in DRAWN_FROM.items() if book_part(chapter) != "II" or chapter < first}
        drawn = set(ROADMAP_PARTS) - beyond
        assert set(boxes) == drawn, chapter
        lit = {gid for gid, box in boxes.items() if box.get_facecolor()[:3] == to_rgba(HIGHLIGHT_COLOUR)[:3]}
        assert lit == set(parts) and lit, chapter
        assert name in fig.axes[0].get_title() and chapter in fig.axes[0].get_title()
        texts = [t.get_text() for t in fig.axes[0].texts]
        # under the KV blocks: every chapter and appendix that works on them, and only those (the capstone
        # runs every part: it is named in none)
        assert "  ".join(c for c, (_, p) in ROADMAP_CHAPTERS.items() if "cache" in p and c != "C1") in texts
        plt.close(fig)
    # every part of the pipeline is some chapter's subject
    assert set().union(*(p for _, p in ROADMAP_CHAPTERS.values())) == set(ROADMAP_PARTS)
    for bad in ["09", "3", 3, None, "A8"]:
        with pytest.raises(ValueError, match="chapter must be one of"):
            roadmap(bad)
    # 00 draws the whole map: every part with its chapters, none highlighted
    fig = roadmap("00")
    boxes = {p.get_gid(): p for p in fig.axes[0].patches if p.get_gid()}
    assert set(boxes) == set(ROADMAP_PARTS)
    assert not any(box.get_facecolor()[:3] == to_rgba(HIGHLIGHT_COLOUR)[:3] for box in boxes.values())
    assert "00" not in " ".join(t.get_text() for t in fig.axes[0].texts)
    plt.close(fig)


def test_the_book_has_two_parts_and_appendices():
    """Part I follows the article (01 to 06, closed by the capstone C1); Part II (07 on) goes beyond it,
    and its roadmap puts the router in front of N replicas, each with its own pool and prefix cache."""
    import matplotlib.pyplot as plt
    import pytest

    from labkit.teaching.diagrams import ROADMAP_CHAPTERS, book_part, roadmap

    parts = {c: book_part(c) for c in ("00", *ROADMAP_CHAPTERS)}
    assert {c for c, p in parts.items() if p == "I"} == {"00", "01", "02", "03", "04", "05", "06", "C1"}
    assert {c for c, p in parts.items() if p == "II"} == {"07", "08"}
    assert {c for c, p in parts.items() if p == "A"} == {f"A{i}" for i in range(1, 8)}
    with pytest.raises(ValueError, match="chapter must be one of"):
        book_part("09")
    for chapter in ("07", "08", "00"):
        fig = roadmap(chapter)
        texts = [t.get_text() for t in fig.axes[0].texts]
        assert "router: which replica" in texts and "replica 1" in texts and "replica N−1" in texts
        assert any("its own pool and its own prefix cache" in t for t in texts)
        plt.close(fig)
    assert "beyond the article" in roadmap("07").axes[0].get_title()
    plt.close("all")


def test_from_chapter_08_the_roadmap_draws_the_second_tier_and_the_decode_pool():
    """08 (and the whole map) put a second tier under the KV blocks, evicting into it and reloading from it,
    and a decode pool that receives the prefill pool's K/V over a link; 07's figure has neither."""
    import matplotlib.pyplot as plt

    from labkit.teaching.diagrams import ROADMAP_PARTS, roadmap

    for chapter in ("08", "00"):
        fig = roadmap(chapter)
        texts = [t.get_text() for t in fig.axes[0].texts]
        gids = {p.get_gid() for p in fig.axes[0].patches}
        assert {"tier", "pool"} <= gids, chapter
        assert ROADMAP_PARTS["tier"] == "second tier: host memory, disk, another machine"
        assert ROADMAP_PARTS["tier"] in texts
        assert "decode pool" in texts and "evict" in texts and any(t.startswith("reload") for t in texts)
        assert any("over a link" in t for t in texts) and any("prefill pool" in t for t in texts)
        plt.close(fig)
    fig = roadmap("07")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert not {"tier", "pool"} & {p.get_gid() for p in fig.axes[0].patches}
    assert "evict" not in texts and not any("over a link" in t for t in texts)
    plt.close(fig)
