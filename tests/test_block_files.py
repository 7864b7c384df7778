"""A KV block written to a file and read back (``labkit.caches.block_files``): the same bytes, or a named
refusal that leaves the pool as it was."""

from __future__ import annotations

import pytest
import torch

from labkit.caches.block_files import BlockFileError, read_block, write_block
from labkit.caches.paged import KVPool
from labkit.model.decoder import DecoderConfig

CONFIG = DecoderConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def pool(seed: int = 0, dtype=torch.float32) -> KVPool:
    p = KVPool(CONFIG, num_blocks=6, block_size=4, dtype=dtype, use_triton=False)
    g = torch.Generator().manual_seed(seed)
    for cache in p.k_caches + p.v_caches:
        cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_comes_back_bit_for_bit(tmp_path, dtype):
    src, dst = pool(1, dtype), pool(2, dtype)
    n = write_block(src, 3, "abc", tmp_path / "b")
    assert n == (tmp_path / "b").stat().st_size and read_block(dst, 5, "abc", tmp_path / "b") == src.bytes_per_block
    for layer in range(3):
        assert torch.equal(dst.k_caches[layer][5], src.k_caches[layer][3])
        assert torch.equal(dst.v_caches[layer][5], src.v_caches[layer][3])
        assert torch.equal(dst.k_caches[layer][4], pool(2, dtype).k_caches[layer][4])  # nothing else written


def _damaged(tmp_path, how):
    path = tmp_path / "b"
    write_block(pool(1), 3, "abc", path)
    data = bytearray(path.read_bytes())
    if how == "cut short":
        data = data[:-7]
    elif how == "a flipped bit":
        data[-100] ^= 0x10
    elif how == "too long":
        data += b"\0"
    elif how == "no magic":
        data[:4] = b"JUNK"
    elif how == "header cut":
        data = data[:20]
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how, says", [("cut short", "cut short"), ("a flipped bit", "checksum"),
                                       ("too long", "too long"), ("no magic", "not a block file"),
                                       ("header cut", "header")])
def test_a_damaged_file_is_refused_and_the_pool_is_unchanged(tmp_path, how, says):
    dst = pool(2)
    before = [c.clone() for c in dst.k_caches + dst.v_caches]
    path = _damaged(tmp_path, how)
    with pytest.raises(BlockFileError, match=f"{path}.*{says}"):
        read_block(dst, 5, "abc", path)
    assert all(torch.equal(a, b) for a, b in zip(before, dst.k_caches + dst.v_caches))


def test_another_blocks_or_another_pools_file_is_refused(tmp_path):
    write_block(pool(1), 3, "abc", tmp_path / "b")
    with pytest.raises(BlockFileError, match="holds block 'abc', not 'abd'"):
        read_block(pool(2), 5, "abd", tmp_path / "b")
    other = KVPool(DecoderConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
                   num_blocks=6, block_size=4, use_triton=False)
    with pytest.raises(BlockFileError, match="written for a pool of"):
        read_block(other, 5, "abc", tmp_path / "b")
    with pytest.raises(BlockFileError, match="cannot be read"):
        read_block(pool(2), 5, "abc", tmp_path / "missing")


def test_bad_arguments_name_themselves(tmp_path):
    for args, name in [((None, 0, "a"), "pool"), ((pool(), 6, "a"), "block_id"), ((pool(), -1, "a"), "block_id"),
                       ((pool(), 0, ""), "name")]:
        with pytest.raises(ValueError, match=name):
            write_block(*args, tmp_path / "x")
    assert not (tmp_path / "x").exists()
