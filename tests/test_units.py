import pytest

from labkit.units import format_bytes


@pytest.mark.parametrize("n, unit, text", [
    (131_072, "bytes", "131,072 bytes"), (131_072, None, "128 KiB"), (2**30, None, "1 GiB"),
    (2**29, "GiB", "0.5 GiB"), (2**28, "GiB", "0.25 GiB"), (1.75 * 2**30, None, "1.75 GiB"),
    (3 * 2**30, None, "3 GiB"), (2 * 2**20, None, "2 MiB"), (11 * 131_072, None, "1.375 MiB"),
    (999, None, "999 bytes"), (1023, None, "1,023 bytes"), (1024, None, "1 KiB"), (-2048, None, "-2 KiB"),
])
def test_the_books_way_of_writing_sizes(n, unit, text):
    assert format_bytes(n, unit) == text


def test_unknown_unit():
    with pytest.raises(ValueError, match="unit"):
        format_bytes(1, "GB")
