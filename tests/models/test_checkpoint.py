"""save_pretrained / from_pretrained: round trip, mamba-ssm's and transformers' layouts, errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ssm import MambaConfig, MambaLM


def tiny(**kw) -> MambaLM:
    torch.manual_seed(0)
    return MambaLM(MambaConfig(**{**dict(d_model=32, n_layer=2, vocab_size=45, ssm_cfg={"d_state": 8}), **kw})).eval()


IDS = torch.randint(0, 45, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("safe", [False, True])
@pytest.mark.parametrize("kw", [{}, dict(ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 8}, d_intermediate=64)])
def test_round_trip_gives_identical_logits(tmp_path, kw, safe):
    model = tiny(**kw)
    model.save_pretrained(tmp_path, safe_serialization=safe)
    loaded = MambaLM.from_pretrained(tmp_path)
    assert loaded.config == model.config
    assert torch.equal(loaded(IDS), model(IDS))
    assert loaded.lm_head.weight is loaded.backbone.embedding.weight
    assert getattr(loaded.backbone.layers[0].mixer.A_log, "_no_weight_decay", False)


def test_mamba_ssm_config_file_as_published(tmp_path):
    """config.json exactly as the state-spaces mamba checkpoints ship it (fields omitted take
    their defaults), with a state dict under mamba-ssm's key names."""
    published = {
        "d_model": 32,
        "n_layer": 2,
        "vocab_size": 45,
        "ssm_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 8,
    }
    source = tiny(ssm_cfg={})
    (tmp_path / "config.json").write_text(json.dumps(published))
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = MambaLM.from_pretrained(tmp_path)
    assert loaded.backbone.embedding.weight.shape == (48, 32)
    assert torch.equal(loaded(IDS), source(IDS))


def hf_state_dict(model: MambaLM) -> dict:
    """The model's weights under transformers' MambaForCausalLM names, LM head omitted (tied)."""
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        sd[k.replace("backbone.embedding.", "backbone.embeddings.")] = v
    return sd


def test_transformers_mamba_layout(tmp_path):
    source = tiny(ssm_cfg={}, pad_vocab_size_multiple=1, vocab_size=48)
    hf_config = {
        "model_type": "mamba",
        "architectures": ["MambaForCausalLM"],
        "hidden_size": 32,
        "state_size": 16,
        "num_hidden_layers": 2,
        "vocab_size": 48,
        "expand": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": "auto",
        "intermediate_size": 64,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": True,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    save_file(hf_state_dict(source), tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = MambaLM.from_pretrained(tmp_path)
    assert torch.equal(loaded(IDS), source(IDS))


def test_transformers_mamba2_layout(tmp_path):
    source = tiny(
        ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2, "chunk_size": 8},
        pad_vocab_size_multiple=1,
        vocab_size=48,
    )
    hf_config = {
        "model_type": "mamba2",
        "hidden_size": 32,
        "state_size": 8,
        "num_hidden_layers": 2,
        "vocab_size": 48,
        "expand": 2,
        "conv_kernel": 4,
        "head_dim": 16,
        "num_heads": 4,
        "n_groups": 2,
        "chunk_size": 8,
        "use_bias": False,
        "use_conv_bias": True,
        "rms_norm": True,
        "residual_in_fp32": True,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, float("inf")],
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    torch.save(hf_state_dict(source), tmp_path / "pytorch_model.bin")
    loaded = MambaLM.from_pretrained(tmp_path)
    assert torch.equal(loaded(IDS), source(IDS))


def test_safetensors_file_as_transformers_expects_it(tmp_path):
    """save_pretrained(safe_serialization=True) writes what transformers' loader asks for: the
    "pt" format tag and every tensor but the tied head, in its own dtype."""
    model = tiny().to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    stored = load_file(tmp_path / "model.safetensors")
    assert set(stored) == set(model.state_dict()) - {"lm_head.weight"}
    for key, value in model.state_dict().items():
        if key != "lm_head.weight":
            assert stored[key].dtype == torch.bfloat16 and torch.equal(stored[key], value), key
    assert MambaLM.from_pretrained(tmp_path).backbone.norm_f.weight.dtype == torch.bfloat16


def test_damaged_safetensors_file_is_named(tmp_path):
    tiny().save_pretrained(tmp_path, safe_serialization=True)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        MambaLM.from_pretrained(tmp_path)


class CreatesAFile:
    """Unpickling this calls os.system, which creates the file ``target``."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return os.system, (f"touch '{self.target}'",)


def test_pickled_code_in_a_checkpoint_never_runs(tmp_path):
    model_dir, target = tmp_path / "model", tmp_path / "pwned"
    tiny().save_pretrained(model_dir)
    state = torch.load(model_dir / "pytorch_model.bin", weights_only=True)
    state["backbone.norm_f.weight"] = CreatesAFile(target)
    torch.save(state, model_dir / "pytorch_model.bin")  # torch's own file layout, as a real checkpoint
    with pytest.raises(ValueError, match=r"pytorch_model.bin holds pickled objects other than tensors.*refusing"):
        MambaLM.from_pretrained(model_dir)
    assert not target.exists()
    # The payload is live: loading that runs code creates the file.
    torch.load(model_dir / "pytorch_model.bin", weights_only=False)
    assert target.exists()


def test_mismatched_checkpoints_name_the_key(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    sd = torch.load(tmp_path / "pytorch_model.bin")
    sd.pop("backbone.layers.1.mixer.D")
    sd["backbone.layers.0.mixer.extra"] = torch.zeros(1)
    sd["backbone.norm_f.weight"] = torch.ones(31)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        MambaLM.from_pretrained(tmp_path)
    message = str(err.value)
    assert "missing keys ['backbone.layers.1.mixer.D']" in message
    assert "unexpected keys ['backbone.layers.0.mixer.extra']" in message
    assert "backbone.norm_f.weight: checkpoint (31,), model (32,)" in message


def test_bad_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        MambaLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 8, "n_layer": 1, "vocab_size": 5}))
    with pytest.raises(FileNotFoundError, match="no weights"):
        MambaLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 8, "n_layers": 1}))
    with pytest.raises(ValueError, match=r"unknown MambaConfig field\(s\) \['n_layers'\]"):
        MambaLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        MambaLM.from_pretrained(tmp_path)


def dead_pid() -> int:
    """The pid of a process that has ended (a child started and waited for)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("first,second", [(True, False), (False, True)], ids=["st-then-bin", "bin-then-st"])
def test_a_directory_saved_twice_holds_the_second_model(tmp_path, first, second):
    """Saving into a directory that holds another format's weights, or a sharded copy, leaves
    only the new weights: the stale ones were read first before. Files that are not weights of
    ours stay, whatever their names."""
    from tests.models.test_hub import write_sharded

    old, new = tiny(), tiny(d_model=32)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1)
    write_sharded(old, tmp_path, "bin" if first else "safetensors")  # a sharded copy (other shard names)
    old.save_pretrained(tmp_path, safe_serialization=first)
    others = ["notes.txt", "tokenizer.json", "model-final.safetensors", "my.bin", "model.safetensors.bak"]
    for name in others:
        (tmp_path / name).write_text("not ours")
    new.save_pretrained(tmp_path, safe_serialization=second)
    weights = "model.safetensors" if second else "pytorch_model.bin"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", weights, *others])
    assert torch.equal(MambaLM.from_pretrained(tmp_path)(IDS), new(IDS))


def test_a_directory_with_two_weight_sets_is_refused_naming_both(tmp_path):
    """Two sets that differ (a stale one beside the model): which is the model is unknown."""
    from tests.models.test_hub import write_sharded

    model, stale = tiny(), tiny()
    with torch.no_grad():
        stale.backbone.norm_f.weight.add_(1.0)  # another model of the same shapes, as an older save left it
    model.save_pretrained(tmp_path / "a", safe_serialization=True)
    torch.save(stale.state_dict(), tmp_path / "a" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"a holds 2 weight sets, model.safetensors and pytorch_model.bin, and which"):
        MambaLM.from_pretrained(tmp_path / "a")
    write_sharded(model, tmp_path / "b")  # a single file beside an index
    torch.save(stale.state_dict(), tmp_path / "b" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json and pytorch_model.bin, and which"):
        MambaLM.from_pretrained(tmp_path / "b")


def test_a_directory_with_copies_of_one_model_in_two_formats_loads(tmp_path):
    """A clone of a hub repo that publishes one model as .safetensors and as .bin (many -hf
    repos do): the sets hold the same tensors (safetensors without the tied head), so it loads."""
    model = tiny()
    model.save_pretrained(tmp_path, safe_serialization=True)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    torch.testing.assert_close(MambaLM.from_pretrained(tmp_path)(IDS), model(IDS), rtol=0, atol=0)


def test_a_save_that_fails_leaves_the_old_model_and_orphans_go(tmp_path, monkeypatch):
    old = tiny()
    old.save_pretrained(tmp_path)
    orphan = tmp_path / f".pytorch_model.bin.{dead_pid()}.tmp"  # left by a save killed while writing
    live = tmp_path / f".pytorch_model.bin.{os.getppid()}.tmp"  # a save in progress elsewhere (a live pid)
    orphan.write_bytes(b"x" * 100)
    live.write_bytes(b"x")

    def disk_full(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        tiny(d_model=32, n_layer=1).save_pretrained(tmp_path)
    monkeypatch.undo()
    assert not orphan.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", "pytorch_model.bin", live.name])
    assert torch.equal(MambaLM.from_pretrained(tmp_path)(IDS), old(IDS))
