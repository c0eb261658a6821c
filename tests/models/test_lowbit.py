"""Low-precision decoding of a MambaLM: a bfloat16 / float16 model and an int8 / int4 quantised
one (``MambaLM.quantize``, with int8 or float32 activations) decode through the fused C step,
which equals the model's own tensor path (the C kernels switched off) on the same weights;
quantised checkpoints save and load without quantising again; the errors name the argument."""

from __future__ import annotations

import gc
import json
import sys

import pytest
import torch

from ssm import MambaConfig, MambaLM
from ssm.layers.quant import QuantEmbedding, QuantLinear
from ssm.native import library
from ssm.ops import decode

CONFIGS = {
    "mamba1": dict(ssm_cfg={"d_state": 8}),
    "mamba2+mlp": dict(ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 4}, d_intermediate=40),
    "mamba1-untied": dict(ssm_cfg={"d_state": 8}, tie_embeddings=False),
    "mamba3": dict(ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "chunk_size": 4}),
    # N·P = 64·24 above the CPU's sweeps: the prompt's state comes from the chunked products,
    # the prompt over two chunks (a last state that is a strided view declined the fused step)
    "mamba3-wide": dict(ssm_cfg={"layer": "Mamba3", "d_state": 64, "headdim": 24, "chunk_size": 2}),
    "mamba3-mimo": dict(
        ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "chunk_size": 4, "is_mimo": True, "mimo_rank": 2}
    ),
    "hybrid": dict(  # an attention block (rotary, a conv, a fused MLP) after a Mamba-2 block
        ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 4},
        attn_layer_idx=[1],
        attn_cfg={"num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 4, "d_conv": 4, "mlp_dim": 16, "causal": True},
    ),
}


def tiny(kind) -> MambaLM:
    """d_model 48: the projections have a full block of 32 inputs and a short one."""
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=48, n_layer=2, vocab_size=45, **CONFIGS[kind])).eval()
    with torch.no_grad():  # larger weights than the init's, so that a wrong rounding shows in the tokens
        for name, p in model.named_parameters():
            if name.endswith(("in_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight")):
                p.mul_(3)
    return model


def decode_both(model, monkeypatch, steps=10):
    """Greedy tokens and the step logits, fused (the C step, which must be taken) and on the
    tensor path (SSM_CPU_KERNEL=0)."""
    if library() is None:
        pytest.fail("the C library did not build: the fused low-precision step is untested")
    ids = torch.randint(0, 45, (3, 4), generator=torch.Generator().manual_seed(2))
    results = []
    prepare = decode.MambaBlocksStep.prepare.__func__
    for env in ("1", "0"):
        monkeypatch.setenv("SSM_CPU_KERNEL", env)
        taken = []

        def spy(cls, *args, **kwargs):
            out = prepare(cls, *args, **kwargs)
            taken.append(out is not None)
            return out

        monkeypatch.setattr(decode.MambaBlocksStep, "prepare", classmethod(spy))
        tokens = model.generate(ids, steps, temperature=0)
        cache = model.allocate_inference_cache(3)
        fixed = torch.randint(0, 45, (3, 4 + steps), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():  # the logits of the same tokens on both paths
            model(fixed[:, :4], cache=cache)
            logits = torch.stack([model.step(fixed[:, t], cache).float() for t in range(4, 4 + steps)], 1)
        results.append((tokens, logits, taken))
    (fused_tokens, fused_logits, taken), (tokens, logits, untaken) = results
    assert taken and all(taken), "the fused step was not taken"
    assert not any(untaken), "the fused step ran without the C library"
    return fused_tokens, fused_logits, tokens, logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["mamba1", "mamba2+mlp", "mamba3"])
def test_a_16bit_model_decodes_through_the_fused_step(kind, dtype, monkeypatch):
    """The fused step keeps the stream in float32 where the tensor path rounds each layer's
    output to 16 bits: the logits agree to 16-bit precision, and the greedy tokens but where
    that rounding decides a near tie (then the rows go their own ways): where a row's tokens
    first differ, the two tokens' logits differ by less than 16-bit rounding there."""
    model = tiny(kind).to(dtype)
    fused_tokens, fused_logits, tokens, logits = decode_both(model, monkeypatch)
    torch.testing.assert_close(fused_logits, logits, rtol=0.05, atol=0.05)
    for row in range(tokens.shape[0]):
        differ = (fused_tokens[row] != tokens[row]).nonzero()
        if len(differ):
            t = int(differ[0])
            with torch.no_grad():
                last = model(tokens[row : row + 1, :t])[0, -1].float()
            assert abs(last[fused_tokens[row, t]] - last[tokens[row, t]]) < 0.05, f"row {row} parts at {t}"


@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_quantised_model_decodes_through_the_fused_step(kind, scheme, activations, monkeypatch):
    """Both paths compute in float32 from the same dequantised weights, and with int8
    activations round each layer's input the same way (the C step in C, the tensor path in
    torch): equal to float32 rounding, and the same tokens."""
    model = tiny(kind).quantize(scheme, activations=activations)
    fused_tokens, fused_logits, tokens, logits = decode_both(model, monkeypatch)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused_tokens, tokens)


def test_int8_weights_keep_the_float_model_s_greedy_tokens():
    model = tiny("mamba2+mlp")
    ids = torch.randint(0, 45, (3, 4), generator=torch.Generator().manual_seed(2))
    want = model.generate(ids, 16, temperature=0)
    assert torch.equal(model.quantize("int8", activations="float32").generate(ids, 16, temperature=0), want)


@pytest.mark.parametrize("kind", ["mamba1", "mamba2+mlp", "mamba3-mimo"])
def test_int8_activations_part_from_the_float_tokens_only_at_near_ties(kind):
    """These small random models' logits are nearly flat (their spread is about 0.13), so the
    activations' rounding changes some greedy tokens. Where a row first parts from the float
    model's, the float model's logits of the two tokens differ by less than 0.02 (measured:
    at most 0.012 over these rows): a near tie. (What the rounding costs a trained model:
    scripts/benchmark.py --op precision; docs/benchmarks-history/2026-11-cpu-decoding.md.)"""
    model = tiny(kind)
    ids = torch.randint(0, 45, (3, 4), generator=torch.Generator().manual_seed(2))
    want = model.generate(ids, 16, temperature=0)
    got = tiny(kind).quantize("int8").generate(ids, 16, temperature=0)
    for row in range(3):
        differ = (got[row] != want[row]).nonzero()
        if len(differ):
            t = int(differ[0])
            with torch.no_grad():
                last = model(want[row : row + 1, :t])[0, -1]
            assert abs(last[got[row, t]] - last[want[row, t]]) < 0.02, f"row {row} parts at {t}"


def test_what_quantize_replaces_and_keeps():
    model = tiny("mamba1")
    dt_proj = model.backbone.layers[0].mixer.dt_proj.weight.clone()
    model.quantize("int8")
    mixer = model.backbone.layers[0].mixer
    assert all(isinstance(m, QuantLinear) for m in (mixer.in_proj, mixer.x_proj, mixer.out_proj, model.lm_head))
    assert isinstance(model.backbone.embedding, QuantEmbedding)  # tied: reads the head's integers
    assert torch.equal(mixer.dt_proj.weight, dt_proj)  # the Δ projection stays float
    assert mixer.in_proj.qweight.dtype == torch.int8 and mixer.in_proj.scales.dtype == torch.float32
    # no float matrix left: the largest float tensors are A_log (D, N) = 768 and dt_proj (D, R) = 288
    assert max(p.numel() for p in model.parameters()) <= 768
    model.to(torch.bfloat16)
    assert mixer.in_proj.scales.dtype == torch.float32  # the scales never narrow
    untied = tiny("mamba1-untied").quantize("int8")
    assert isinstance(untied.backbone.embedding, torch.nn.Embedding)
    hybrid = tiny("hybrid").quantize("int8")  # the attention block's projections too
    attention = hybrid.backbone.layers[1].mixer
    assert isinstance(attention.in_proj, QuantLinear) and isinstance(attention.out_proj, QuantLinear)
    hybrid.to(torch.bfloat16)
    assert attention.allocate_inference_cache(1).key.dtype == torch.bfloat16  # the model's float dtype


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("kind", ["mamba1", "mamba2+mlp", "mamba1-untied", "hybrid"])
def test_quantise_save_load_gives_the_same_tokens(kind, safe, tmp_path):
    model = tiny(kind).quantize("int8")
    ids = torch.randint(0, 45, (2, 4), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, 12, temperature=0)
    model.save_pretrained(tmp_path, safe_serialization=safe)
    spec = json.loads((tmp_path / "quantization_config.json").read_text())
    assert spec["scheme"] == "int8" and spec["block_size"] == 32 and "lm_head" in spec["modules"]
    assert spec["activations"] == "int8"
    loaded = MambaLM.from_pretrained(tmp_path)
    assert loaded.quantization == model.quantization
    assert loaded.lm_head.activations == "int8"
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name  # loaded as saved, not quantised again
    assert torch.equal(loaded.generate(ids, 12, temperature=0), want)
    # a float model saved over it leaves no stale quantization_config.json
    tiny(kind).save_pretrained(tmp_path, safe_serialization=safe)
    assert not (tmp_path / "quantization_config.json").exists()
    assert MambaLM.from_pretrained(tmp_path).quantization is None


def test_activations_are_saved_loaded_and_changed(tmp_path):
    """activations="float32" is recorded and loaded back; ``from_pretrained(activations=)`` and
    ``set_activations`` change every quantised layer (the integers stay as stored); a checkpoint
    saved before the field existed loads with the default, int8."""
    model = tiny("mamba2+mlp").quantize("int4", activations="float32")
    ids = torch.randint(0, 45, (2, 4), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, 12, temperature=0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = MambaLM.from_pretrained(tmp_path)
    layers = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.activations == "float32" for m in layers)
    assert torch.equal(loaded.generate(ids, 12, temperature=0), want)
    switched = MambaLM.from_pretrained(tmp_path, activations="int8")
    assert all(m.activations == "int8" for m in switched.modules() if isinstance(m, QuantLinear))
    assert switched.quantization["activations"] == "int8"
    assert torch.equal(
        model.set_activations("int8").generate(ids, 12, temperature=0), switched.generate(ids, 12, temperature=0)
    )
    spec = json.loads((tmp_path / "quantization_config.json").read_text())
    del spec["activations"]
    (tmp_path / "quantization_config.json").write_text(json.dumps(spec))
    assert MambaLM.from_pretrained(tmp_path).quantization["activations"] == "int8"


def test_from_pretrained_quantize_equals_quantize(tmp_path):
    tiny("mamba1").save_pretrained(tmp_path)
    a = MambaLM.from_pretrained(tmp_path, quantize="int4")
    b = tiny("mamba1").quantize("int4")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


@pytest.mark.skipif(sys.platform != "linux", reason="reads the process's memory maps in /proc/self/maps")
def test_a_model_quantised_after_loading_releases_the_checkpoint_s_memory_map(tmp_path):
    """Tensors loaded from a safetensors file are views of its memory map; the ones that stay
    float after quantising (norms, conv, A, D) get storage of their own, so that the file, whose
    float matrices' pages quantising read, is no longer mapped (it stayed resident: --op memory
    measured 1,022 MiB before decoding for int8 at mamba-130m's shapes, 588 after this)."""

    def mapped() -> bool:
        gc.collect()
        with open("/proc/self/maps") as f:
            return any(str(tmp_path / "model.safetensors") in line for line in f)

    tiny("mamba1").save_pretrained(tmp_path, safe_serialization=True)
    model = MambaLM.from_pretrained(tmp_path)
    assert mapped()  # the float model reads its weights from the map (what this test relies on)
    del model
    assert not mapped()
    model = MambaLM.from_pretrained(tmp_path, quantize="int8")
    assert not mapped(), "the quantised model still holds views of the checkpoint's memory map"
    head = model.lm_head
    assert model.backbone.embedding._head[0] is head  # tying kept: the embedding reads the head's integers


def test_bad_quantisation_requests_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="scheme must be one of \\['int8', 'int4'\\], got 'int3'"):
        tiny("mamba1").quantize("int3")
    model = tiny("mamba1").quantize("int8")
    with pytest.raises(ValueError, match="scheme 'int4': this model is already quantised \\(int8\\)"):
        model.quantize("int4")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="already quantised"):
        MambaLM.from_pretrained(tmp_path, quantize="int8")
    with pytest.raises(ValueError, match=r"activations must be one of \['float32', 'int8'\], got 'int4'"):
        MambaLM.from_pretrained(tmp_path, activations="int4")
    with pytest.raises(ValueError, match=r"activations must be one of \['float32', 'int8'\], got 'bf16'"):
        tiny("mamba1").quantize("int8", activations="bf16")
    with pytest.raises(ValueError, match="activations='int8' applies to a quantised model"):
        tiny("mamba1").set_activations("int8")
    (tmp_path / "quantization_config.json").write_text(json.dumps({**model.quantization, "activations": "fp8"}))
    with pytest.raises(ValueError, match="quantization_config.json's 'activations' must be one of"):
        MambaLM.from_pretrained(tmp_path)
    (tmp_path / "quantization_config.json").write_text(json.dumps({**model.quantization, "scheme": "int2"}))
    with pytest.raises(ValueError, match="quantization_config.json's 'scheme' must be one of"):
        MambaLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["mamba1", "mamba3"])
def test_a_quantised_model_never_widens_a_whole_large_matrix(kind, scheme):
    """Memory: a quantised model's prefill (the tensor path) widens its matrices 1024 rows at a
    time and its fused decoding step reads them as stored, so no float tensor (views aside) as
    large as the head's matrix (2500 x 48 here) is ever made, in prefill or in decoding. The
    check sees a whole matrix widened (dequantize_rows over every row)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ssm.ops.quant import dequantize_rows

    if library() is None:
        pytest.fail("the C library did not build: the fused low-precision step is untested")
    torch.manual_seed(0)
    config = MambaConfig(d_model=48, n_layer=2, vocab_size=2500, **{k: v for k, v in CONFIGS[kind].items()})
    model = MambaLM(config).eval()
    limit = model.lm_head.weight.numel()  # the largest matrix

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not t._is_view():
                    self.largest = max(self.largest, t.numel())
            return out

    ids = torch.randint(0, 2500, (1, 5), generator=torch.Generator().manual_seed(0))

    def widest(m) -> int:
        with torch.no_grad(), Largest() as seen:
            m.generate(ids, 4, temperature=0)
        return seen.largest

    model.quantize(scheme)
    assert widest(model) < limit, "a quantised matrix was widened whole"
    with Largest() as seen:  # the check itself: a whole matrix widened is seen
        dequantize_rows(model.lm_head.matrix())
    assert seen.largest >= limit


# transformers' layouts are written here with the tied head only (as transformers writes it)
READ_CASES = [("mamba1", f) for f in ("bin", "safetensors", "sharded safetensors", "sharded bin", "transformers")]
READ_CASES += [("mamba1-untied", f) for f in ("bin", "safetensors")]


@pytest.mark.parametrize("dtype,scheme", [(torch.bfloat16, None), (None, "int8"), (torch.float16, "int4")])
@pytest.mark.parametrize("kind,fmt", READ_CASES)
def test_converting_and_quantising_while_reading_equals_doing_it_after(kind, fmt, dtype, scheme, tmp_path):
    """from_pretrained(dtype=, quantize=) converts (and quantises) each tensor as it is read;
    the model equals the one loaded whole, then moved to dtype, then quantised: every tensor of
    its state dict, tied head included, in every checkpoint layout."""
    from tests.models.test_checkpoint import hf_state_dict
    from tests.models.test_hub import write_sharded

    source = tiny(kind)
    if fmt in ("transformers", "sharded safetensors", "sharded bin"):  # transformers' names, tied head left out
        if fmt == "transformers":
            from safetensors.torch import save_file

            save_file(hf_state_dict(source), tmp_path / "model.safetensors", metadata={"format": "pt"})
        else:
            write_sharded(source, tmp_path, fmt.split()[1])
        config = {
            "model_type": "mamba", "hidden_size": 48, "state_size": 8, "num_hidden_layers": 2, "vocab_size": 48,
            "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": "auto",
            "intermediate_size": 96, "layer_norm_epsilon": 1e-5, "residual_in_fp32": True,
            "tie_word_embeddings": True, "pad_token_id": 0,
        }  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps(config))
    else:
        source.save_pretrained(tmp_path, safe_serialization=fmt == "safetensors")
    streamed = MambaLM.from_pretrained(tmp_path, dtype=dtype, quantize=scheme)
    after = MambaLM.from_pretrained(tmp_path).to(dtype or torch.float32)
    after = after if scheme is None else after.quantize(scheme)
    a, b = streamed.state_dict(), after.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert streamed.quantization == after.quantization
    ids = torch.randint(0, 45, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(streamed(ids), after(ids))
