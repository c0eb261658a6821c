"""from_pretrained beyond one local file: sharded checkpoints (safetensors and pickled, with
their index), hub repo ids read from a hub cache laid out as huggingface_hub lays it out, dtype,
and the errors for a missing shard, a tensor listed twice, a name that is nowhere.

The shards and the cache are written here by hand, file by file, from transformers' and
huggingface_hub's documented layouts, not by the code under test."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ssm import MambaConfig, MambaLM

ROOT = Path(__file__).resolve().parents[2]
IDS = torch.randint(0, 45, (2, 9), generator=torch.Generator().manual_seed(1))


HF_CONFIG = {
    "model_type": "mamba",
    "hidden_size": 32,
    "state_size": 8,
    "num_hidden_layers": 2,
    "vocab_size": 48,
    "expand": 2,
    "conv_kernel": 4,
    "time_step_rank": "auto",
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}


def hf_model() -> MambaLM:
    torch.manual_seed(0)
    config = MambaConfig(d_model=32, n_layer=2, vocab_size=48, pad_vocab_size_multiple=1, ssm_cfg={"d_state": 8})
    return MambaLM(config).eval()


def write_sharded(model: MambaLM, directory: Path, fmt: str = "safetensors") -> list[str]:
    """transformers' sharded layout: the weights (transformers' names, tied head left out) in two
    files model-0000k-of-00002.<ext> and an index {"metadata": ..., "weight_map": {name: file}}."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    state = {
        k.replace("backbone.embedding.", "backbone.embeddings."): v.contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    keys = sorted(state)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    prefix = "model" if fmt == "safetensors" else "pytorch_model"
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    names = [f"{prefix}-0000{i + 1}-of-00002.{ext}" for i in range(2)]
    weight_map = {}
    for name, half in zip(names, halves):
        part = {k: state[k] for k in half}
        if fmt == "safetensors":
            save_file(part, directory / name, metadata={"format": "pt"})
        else:
            torch.save(part, directory / name)
        weight_map.update(dict.fromkeys(half, name))
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())}}
    index["weight_map"] = weight_map
    (directory / f"{prefix}.{ext}.index.json").write_text(json.dumps(index, indent=2))
    return names


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_and_unsharded_copies_give_equal_logits(tmp_path, fmt):
    model = hf_model()
    write_sharded(model, tmp_path / "sharded", fmt)
    model.save_pretrained(tmp_path / "whole", safe_serialization=True)
    sharded = MambaLM.from_pretrained(tmp_path / "sharded")
    whole = MambaLM.from_pretrained(tmp_path / "whole")
    assert torch.equal(sharded(IDS), whole(IDS))
    assert torch.equal(sharded(IDS), model(IDS))
    assert sharded.lm_head.weight is sharded.backbone.embedding.weight


def test_dtype_and_device_arguments(tmp_path):
    write_sharded(hf_model(), tmp_path)
    for dtype in (torch.bfloat16, "bfloat16", "torch.bfloat16"):
        loaded = MambaLM.from_pretrained(tmp_path, dtype=dtype, device="cpu")
        assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert MambaLM.from_pretrained(tmp_path, dtype="auto").backbone.norm_f.weight.dtype == torch.float32
    with pytest.raises(ValueError, match=r"dtype must be .* got 'int8'"):
        MambaLM.from_pretrained(tmp_path, dtype="int8")


def test_a_missing_shard_is_named(tmp_path):
    names = write_sharded(hf_model(), tmp_path)
    (tmp_path / names[1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard {names[1]} listed in .*model.safetensors.index.json"):
        MambaLM.from_pretrained(tmp_path)


def test_a_tensor_listed_twice_is_refused(tmp_path):
    names = write_sharded(hf_model(), tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    text = index_path.read_text()
    # a JSON object with the same key twice (json.loads would silently keep the last one)
    text = text.replace('"weight_map": {', f'"weight_map": {{\n    "backbone.norm_f.weight": "{names[0]}",', 1)
    index_path.write_text(text)
    with pytest.raises(ValueError, match=r"names 'backbone.norm_f.weight' twice"):
        MambaLM.from_pretrained(tmp_path)


def test_a_shard_holding_a_tensor_of_another_is_refused(tmp_path):
    names = write_sharded(hf_model(), tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    key = next(k for k, v in index["weight_map"].items() if v == names[1])
    index["weight_map"][key] = names[0]  # the index now points at a shard that lacks it
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"puts \['{key}'\] in {names[0]}, which does not hold them"):
        MambaLM.from_pretrained(tmp_path)


def test_an_index_pointing_outside_its_directory_is_refused(tmp_path):
    write_sharded(hf_model(), tmp_path / "m")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "../elsewhere.safetensors" for k in index["weight_map"]}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists shard '../elsewhere.safetensors'; expected a file name"):
        MambaLM.from_pretrained(tmp_path / "m")


def write_hub_cache(hf_home: Path, repo_id: str, files: dict[str, bytes], commit: str = "a" * 40) -> Path:
    """huggingface_hub's cache: hub/models--owner--name/ with blobs/<sha256> holding the files'
    bytes, snapshots/<commit>/<file> a relative symlink to its blob, refs/main holding the commit."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / name)
    return snapshot


def run_offline(code: str, hf_home: Path) -> subprocess.CompletedProcess:
    """A fresh interpreter (huggingface_hub reads HF_HOME when imported) with the network off."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_a_hub_repo_id_loads_from_the_hub_cache_offline(tmp_path):
    model = hf_model()
    source = tmp_path / "source"
    write_sharded(model, source)
    write_hub_cache(tmp_path / "hf", "owner/tiny-mamba", {p.name: p.read_bytes() for p in source.iterdir()})
    torch.save(IDS, tmp_path / "ids.pt")
    torch.save(model(IDS).detach(), tmp_path / "expected.pt")
    proc = run_offline(
        f"""
import torch
from ssm import MambaLM
model = MambaLM.from_pretrained("owner/tiny-mamba")
ids = torch.load({str(tmp_path / "ids.pt")!r}, weights_only=True)
assert torch.equal(model(ids), torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True))
print("loaded from", model.config.d_model)
try:
    MambaLM.from_pretrained("owner/not-cached")
except FileNotFoundError as err:
    print("ERROR:", err)
""",
        tmp_path / "hf",
    )
    assert proc.returncode == 0, proc.stderr
    assert "loaded from 32" in proc.stdout
    error = proc.stdout.split("ERROR:", 1)[1]
    # both things tried: the directory, and the hub (its cache, offline)
    assert "'owner/not-cached' is not a local directory" in error
    assert "the local hub cache (HF_HUB_OFFLINE is set) could not provide the repo 'owner/not-cached'" in error


def test_a_name_that_is_neither_a_directory_nor_a_repo_id(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a local directory .* not a hub repo id"):
        MambaLM.from_pretrained(str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        MambaLM.from_pretrained(tmp_path / "file")


def test_without_huggingface_hub_or_tokenizers_the_error_says_what_to_install(tmp_path):
    """A fresh interpreter in which huggingface_hub and tokenizers cannot be imported: import ssm
    works, a local directory loads, and a repo id or a tokenizer.json says what to install."""
    hf_model().save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    code = f"""
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("huggingface_hub", "tokenizers"):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NotInstalled())
from ssm import MambaLM
from ssm.models.tokenizer import load_tokenizer
MambaLM.from_pretrained({str(tmp_path / "m")!r})
for call in (lambda: MambaLM.from_pretrained("owner/name"), lambda: load_tokenizer({str(tmp_path / "m")!r})):
    try:
        call()
    except (FileNotFoundError, ImportError) as err:
        print("ERROR:", err)
"""
    proc = run_offline(code, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    hub_error, tokenizer_error = proc.stdout.split("ERROR:")[1:]
    assert "'owner/name' is not a local directory" in hub_error
    assert 'install huggingface_hub: pip install "ssm-scan[hub]"' in hub_error
    assert 'needs the tokenizers library, which is not installed: pip install "ssm-scan[hub]"' in tokenizer_error
