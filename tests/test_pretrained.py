"""labkit.model.pretrained: real checkpoints load into the Decoder and give transformers' logits and tokens.

Everything is offline. transformers builds small random models of each supported variant
and writes them with ``save_pretrained`` (one sharded); ``from_pretrained`` reads the
folder back and must give transformers' own logits, 300 tokens long, within 1e-4 in float32.
The tokenizer is trained here with the ``tokenizers`` library. A Hub id with
``HF_HUB_OFFLINE=1`` must fail at once with an error that names the local-folder alternative.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import labkit  # first: sets up Triton's interpreter without a GPU
from labkit.model import fused
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.model.pretrained import from_pretrained, load_tokenizer, read_safetensors
from labkit.serving.engine import Engine

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
VARIANTS = {
    # A RoPE base other than the default, as Llama 3 has, so a lost rope_theta would show.
    "llama": lambda: transformers.LlamaConfig(**SHAPE, rope_theta=500000.0),
    "llama3_rope": lambda: transformers.LlamaConfig(**SHAPE, rope_theta=500000.0, max_position_embeddings=512,
                                                    rope_scaling=dict(LLAMA3)),
    "tied": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "qwen2_bias": lambda: transformers.Qwen2Config(**SHAPE, rope_theta=1000000.0),
}
SEQ = 300  # > original_max_position_embeddings (64): the llama3 scaling changes the angles used


def random_hf_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(VARIANTS[name](), attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    with torch.no_grad():  # larger than the default init: attention far from uniform, logits far apart
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Each variant saved by transformers; "llama" in shards of 50 KB with an index."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name in VARIANTS:
        hf = random_hf_model(name)
        hf.save_pretrained(root / name, **({"max_shard_size": "50KB"} if name == "llama" else {}))
        out[name] = (root / name, hf)
    return out


def logits_difference(path: Path, hf, seed: int = 1) -> float:
    ids = torch.randint(0, SHAPE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(seed))
    ours = from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return (ours(ids) - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(checkpoints, name):
    path, hf = checkpoints[name]
    assert logits_difference(path, hf) <= 1e-4


def test_the_variants_are_what_they_claim(checkpoints):
    """The checkpoints exercise what they are named for: shards, llama3 angles, tying, biases."""
    shards = sorted(p.name for p in checkpoints["llama"][0].glob("*.safetensors"))
    assert len(shards) > 1 and (checkpoints["llama"][0] / "model.safetensors.index.json").is_file()

    llama3 = from_pretrained(checkpoints["llama3_rope"][0])
    assert llama3.config.rope_scaling["factor"] == 8.0
    plain = from_pretrained(checkpoints["llama3_rope"][0])
    plain.config.rope_scaling = None  # the same weights with unscaled RoPE: clearly different logits
    ids = torch.randint(0, SHAPE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (llama3(ids) - plain(ids)).abs().max().item() > 1e-2

    tied_path = checkpoints["tied"][0]
    assert "lm_head.weight" not in read_safetensors(tied_path)  # stored once
    tied = from_pretrained(tied_path)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight

    qwen = from_pretrained(checkpoints["qwen2_bias"][0], prepare=False)  # chapter 01's modules, to look at
    assert qwen.config.qkv_bias and qwen.model.layers[0].self_attn.k_proj.bias.abs().sum() > 0


def test_a_float32_model_is_loaded_prepared_and_one_flag_gives_the_plain_one(checkpoints):
    """On a CPU in float32 the loader prepares the model as the engine runs it (fused, prepacked, frozen);
    prepare=False gives chapter 01's modules. Same names, same weights, logits within float32 reordering."""
    from labkit.model.decoder import Attention
    from labkit.model.fused import is_prepared

    path = checkpoints["qwen2_bias"][0]
    served, plain = from_pretrained(path, dtype=torch.float32), from_pretrained(path, dtype=torch.float32, prepare=False)
    assert is_prepared(served) and not is_prepared(plain) and type(plain.model.layers[0].self_attn) is Attention
    assert not any(p.requires_grad for p in served.parameters()) and all(p.requires_grad for p in plain.parameters())
    ours, theirs = served.state_dict(), plain.state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = plain.double()(ids)
        assert (served(ids) - exact).abs().max() <= 2 * (plain.float()(ids) - exact).abs().max() + 1e-6
    assert not is_prepared(from_pretrained(path, dtype=torch.bfloat16))  # prepared only in float32 on the CPU
    with pytest.raises(ValueError, match="prepare must be True or False"):
        from_pretrained(path, prepare="yes")


def test_dtype_and_device(checkpoints):
    model = from_pretrained(checkpoints["tied"][0], dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="dtype"):
        from_pretrained(checkpoints["tied"][0], dtype=torch.int8)


def mixed_dtype_copy(src: Path, dst: Path, config_dtype: str | None) -> Path:
    """``src`` rewritten as some checkpoints are stored: norms in float32, every other tensor in bfloat16."""
    import shutil
    shutil.copytree(src, dst)
    tensors = read_safetensors(dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    mixed = {k: (v.float() if "norm" in k else v.to(torch.bfloat16)).contiguous() for k, v in tensors.items()}
    safetensors_torch.save_file(mixed, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if config_dtype is not None:
        config["torch_dtype"] = config_dtype
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("config_dtype, expected", [("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                                    (None, torch.bfloat16)])
def test_dtype_none_loads_one_dtype_and_runs(checkpoints, tmp_path, config_dtype, expected):
    # float32 norms, bf16 linears: kept as stored, the first matmul fails ("expected m1 and m2 to have the
    # same dtype"). As transformers' dtype="auto": config.json's torch_dtype, else the first float tensor's.
    path = mixed_dtype_copy(checkpoints["llama"][0], tmp_path / "mixed", config_dtype)
    stored = {v.dtype for v in read_safetensors(path).values()}
    assert stored == {torch.float32, torch.bfloat16}
    first = next(v.dtype for v in read_safetensors(path).values() if v.is_floating_point())
    model = from_pretrained(path)
    assert {p.dtype for p in model.parameters()} == {expected if config_dtype else first}
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(logits).all()


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos: list[int] | None) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["qwen2_bias", "llama3_rope"])
def test_engine_greedy_tokens_equal_transformers_generate(checkpoints, name):
    """The engine (paged Triton kernels, prefix cache, chunked prefill) serves the loaded model unchanged."""
    path, hf = checkpoints[name]
    model = from_pretrained(path, dtype=torch.float32).to(labkit.DEVICE)
    shared = [7, 3, 91, 45, 12, 60, 8, 33]
    prompts = [shared + [5, 17], shared + [99], [4, 4, 2]]
    engine = Engine(model, num_blocks=24, block_size=4, max_num_batched_tokens=16, use_triton=True)
    assert engine.backend.use_triton
    new = 8
    got = engine.generate(prompts[:1], new, eos_token_id=())  # no early stop
    got += engine.generate(prompts[1:], new, eos_token_id=())   # the second finds the shared blocks cached
    assert got == [hf_greedy(hf, p, new, eos=None) for p in prompts]
    assert sum(s.prefix_hit_tokens for s in engine.stats) == 8  # two blocks of 4 reused

    # EOS as a list (Llama 3 instruct models stop on several ids): stop at the third token of the
    # first reply; an id that never comes first in the list, so the engine's own check is used.
    stop = [SHAPE["vocab_size"] - 1 if got[0][2] != SHAPE["vocab_size"] - 1 else 0, got[0][2]]
    # the CPU's batched path this time (test_kernels proves it equal to the references): far faster than the
    # interpreter. On a CPU the engine prepared the model (fused, packed): the tokens must still be transformers'.
    assert fused.is_prepared(model) == fused.can_prepare(model)
    engine = Engine(model, num_blocks=24, block_size=4, max_num_batched_tokens=16, use_triton=False)
    with_eos = engine.generate(prompts, new, eos_token_id=stop)
    assert with_eos == [hf_greedy(hf, p, new, eos=stop) for p in prompts]
    assert len(with_eos[0]) <= 3 and with_eos[0][-1] == got[0][2]
    assert engine.scheduler.allocator.num_free == 24


def test_engine_stops_on_the_config_eos_by_default(checkpoints):
    path, hf = checkpoints["tied"]
    model = from_pretrained(path)
    free_run = Engine(model, num_blocks=16, block_size=4, use_triton=False).generate([[1, 2, 3]], 6, eos_token_id=())[0]
    model.config.eos_token_id = free_run[1]  # as if config.json said so
    stopped = Engine(model, num_blocks=16, block_size=4, use_triton=False).generate([[1, 2, 3]], 6)[0]
    assert stopped == free_run[:free_run.index(free_run[1]) + 1]
    with pytest.raises(ValueError, match="eos_token_id"):
        Engine(model, num_blocks=16, block_size=4, use_triton=False).add_request([1], 2, eos_token_id=[SHAPE["vocab_size"]])


# ---------------------------------------------------------------- what is refused
def edited_copy(src: Path, dst: Path, config_edit: dict | None = None, drop: str | None = None,
                add: str | None = None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(config_edit or {})
    (dst / "config.json").write_text(json.dumps(config))
    tensors = read_safetensors(src)
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(4)
    safetensors_torch.save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("edit, field", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_scaling"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"num_experts": 8}, "num_experts"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"model_type": "mistral"}, "model_type"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
])
def test_unsupported_configs_name_the_field(checkpoints, tmp_path, edit, field):
    path = edited_copy(checkpoints["qwen2_bias"][0], tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=field):
        from_pretrained(path)


def test_missing_or_unknown_tensors_are_named(checkpoints, tmp_path):
    src = checkpoints["qwen2_bias"][0]
    key = "model.layers.1.self_attn.v_proj.bias"
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        from_pretrained(edited_copy(src, tmp_path / "missing", drop=key))
    with pytest.raises(ValueError, match=r"q_norm"):  # Qwen3 normalises q and k: not computed here
        from_pretrained(edited_copy(src, tmp_path / "unknown", add="model.layers.0.self_attn.q_norm.weight"))
    with pytest.raises(ValueError, match="path_or_repo_id"):
        from_pretrained(tmp_path / "no such folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        from_pretrained(tmp_path / "empty")


def test_a_hub_id_offline_fails_fast_and_names_the_local_alternative(tmp_path):
    """In a fresh process with HF_HUB_OFFLINE=1 and an empty cache: a clear error, and no connection tried.

    Every name lookup and socket connection is counted (and refused) in that process, so the check does not depend on
    how busy the machine is; the loose time bound only catches a wait on a network timeout.
    """
    code = textwrap.dedent("""
        import socket, time
        tried = []
        def refuse(*args, **kwargs):
            tried.append(args)
            raise OSError("the test refuses name lookups and connections")
        socket.getaddrinfo = socket.socket.connect = refuse
        from labkit.model.pretrained import from_pretrained, load_tokenizer
        for load in (from_pretrained, load_tokenizer):
            start = time.time()
            try:
                load("HuggingFaceTB/SmolLM2-135M-Instruct")
            except ConnectionError as err:
                print(type(err).__name__, round(time.time() - start, 1), err)
        print("connections tried:", len(tried))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("ConnectionError")]
    assert len(lines) == 2, result.stdout + result.stderr
    for line in lines:
        assert float(line.split()[1]) < 30  # seconds: no wait on a network timeout
        assert "HF_HUB_OFFLINE" in line and "local path" in line and "hf download" in line
    assert "connections tried: 0" in result.stdout, result.stdout


# ---------------------------------------------------------------- the tokenizer
@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (GPT-2's kind, SmolLM2's kind) trained here, with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["You are a helpful assistant.", "What is a KV cache?", "Why does the cache grow?"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                chat_template=template)
    folder = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(folder)
    return folder


def chat_ids(tok, system: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Why does the cache grow?"}]
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def test_load_tokenizer_keeps_the_chat_template(tokenizer_folder):
    tok = load_tokenizer(tokenizer_folder)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is a KV cache?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"]  # a special token stays one token
    assert ids.count(tok.eos_token_id) == 2 and tok.decode(ids) == text
    assert len(ids) < len(text) / 2  # trained merges: far fewer tokens than characters


def test_one_more_space_in_the_system_prompt_changes_the_ids(tokenizer_folder):
    """What chapter 04 shows: a system prompt that looks the same, with one more space, is other tokens."""
    tok = load_tokenizer(tokenizer_folder)
    same = chat_ids(tok, "You are a helpful assistant.")
    spaced = chat_ids(tok, "You are a helpful  assistant.")
    assert chat_ids(tok, "You are a helpful assistant.") == same
    first_diff = next(i for i, (a, b) in enumerate(zip(same, spaced)) if a != b)
    assert 2 < first_diff < len(same) - 5  # the ids agree up to the space, and differ from there


@pytest.mark.parametrize("tied,scaled", [(False, False), (True, True)])
def test_to_transformers_gives_the_same_logits_and_generate(tied, scaled):
    from labkit.caches.contiguous import generate
    from labkit.model.pretrained import to_transformers

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64} if scaled else None
    model = Decoder.random(DecoderConfig(tie_word_embeddings=tied, rope_scaling=scaling), seed=4)
    hf = to_transformers(model)
    assert hf.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # shared, not copied
    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() < 1e-4
    prompt = ids[0, :12]
    out = hf.generate(prompt[None], attention_mask=torch.ones(1, 12, dtype=torch.long), max_new_tokens=6,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0, 12:].tolist() == generate(model, prompt.tolist(), 6).tokens


def test_to_transformers_refuses_qkv_bias():
    from labkit.model.pretrained import to_transformers

    with pytest.raises(ValueError, match="model"):
        to_transformers(Decoder.random(DecoderConfig(qkv_bias=True), seed=0))
    with pytest.raises(TypeError, match="model"):
        to_transformers("not a model")
