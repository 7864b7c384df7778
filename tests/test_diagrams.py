"""labkit.diagrams draws what the run counted: one box per prompt token, one cell per layer and position."""

import matplotlib

matplotlib.use("Agg")

from matplotlib.patches import Rectangle  # noqa: E402

from labkit.diagrams import DECODE_COLOUR, PREFILL_COLOUR, prefill_decode_diagram  # noqa: E402


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
