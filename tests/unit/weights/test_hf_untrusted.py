"""A Hugging Face directory is untrusted input: shapes, dtypes, config sizes, index paths and
corrupt files are refused with one line naming the culprit, before anything is written,
copied or allocated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dcp.checkpoint.hf import hf_to_dcp
from dcp.weights import convert
from dcp.weights.convert import SAFETENSORS_INDEX, SINGLE_FILE, load_hf_weights
from dcp.weights.hf_config import model_config_from_hf, read_hf_config
from tests.hf_models import make_hf_model
from tools import convert_checkpoint


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_model(arch, root / arch) for arch in ("llama", "qwen3", "mixtral")}


def _variant(
    source: Path,
    out: Path,
    *,
    config: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A copy of the single-file HF directory ``source`` with config.json fields and tensors
    replaced."""
    out.mkdir(parents=True)
    hf = dict(read_hf_config(source), **(config or {}))
    (out / "config.json").write_text(json.dumps(hf))
    save_file(dict(load_file(source / SINGLE_FILE), **(tensors or {})), str(out / SINGLE_FILE))
    return out


def _no_tensor_data(*args, **kwargs):
    raise AssertionError("tensor data was read before the checkpoint was validated")


def _assert_one_line(exc: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)


# -- tensors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("arch", "name", "shape"),
    [
        ("llama", "model.layers.1.self_attn.o_proj.weight", (32, 16)),
        ("llama", "model.layers.0.post_attention_layernorm.weight", (16,)),
        ("llama", "model.norm.weight", (32, 1)),
        ("llama", "model.layers.0.mlp.up_proj.weight", (72, 16)),
        ("llama", "lm_head.weight", (300, 16)),
        ("qwen3", "model.layers.0.self_attn.k_norm.weight", (8,)),
    ],
)
def test_a_tensor_of_the_wrong_shape_is_refused_before_writing(
    hf_dirs, tmp_path, arch, name, shape
):
    expected = list(load_file(hf_dirs[arch] / SINGLE_FILE)[name].shape)
    bad = _variant(hf_dirs[arch], tmp_path / "bad", tensors={name: torch.zeros(shape)})
    with pytest.raises(ValueError) as exc:
        hf_to_dcp(bad, tmp_path / "dcp")
    _assert_one_line(exc, name, str(bad / SINGLE_FILE), str(expected), str(list(shape)))
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_a_tensor_of_a_non_floating_dtype_is_refused(hf_dirs, tmp_path, dtype):
    name = "model.layers.0.input_layernorm.weight"
    bad = _variant(hf_dirs["llama"], tmp_path / "bad", tensors={name: torch.ones(32, dtype=dtype)})
    with pytest.raises(ValueError) as exc:
        hf_to_dcp(bad, tmp_path / "dcp")
    _assert_one_line(exc, name, str(bad / SINGLE_FILE), "floating")
    assert not (tmp_path / "dcp").exists()


class _CanonicalModel(torch.nn.Module):
    """Zero parameters under the canonical names: what ``load_hf_weights`` copies into."""

    def __init__(self, shapes: dict[str, torch.Size]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in module._modules:
                    module.add_module(part, torch.nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))


def test_load_hf_weights_validates_before_copying_anything(hf_dirs, tmp_path):
    source = hf_dirs["llama"]
    cfg = model_config_from_hf(read_hf_config(source))
    shapes = {n: t.shape for n, t in convert.iter_canonical_from_hf(source, cfg)}
    model = _CanonicalModel(shapes)
    load_hf_weights(model, source, cfg)  # the fake model takes a good checkpoint
    assert all(torch.count_nonzero(p) for p in model.parameters())

    model = _CanonicalModel(shapes)
    name = "model.layers.1.self_attn.o_proj.weight"  # late in the file: others come first
    bad = _variant(source, tmp_path / "bad", tensors={name: torch.zeros(32, 16)})
    with pytest.raises(ValueError) as exc:
        load_hf_weights(model, bad, cfg)
    _assert_one_line(exc, name, "[32, 32]", "[32, 16]")
    assert not any(torch.count_nonzero(p) for p in model.parameters())


# -- config.json ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_attention_heads", 0),
        ("num_key_value_heads", 0),
        ("num_key_value_heads", -2),
        ("num_hidden_layers", 0),
        ("hidden_size", -32),
        ("hidden_size", 1e9),
        ("hidden_size", True),
        ("hidden_size", None),
        ("intermediate_size", 0),
        ("vocab_size", 0),
        ("num_hidden_layers", "2"),
        ("max_position_embeddings", 0),
        ("head_dim", 0),
    ],
)
def test_config_sizes_must_be_positive_integers(hf_dirs, field, value):
    hf = dict(read_hf_config(hf_dirs["llama"]), **{field: value})
    with pytest.raises(ValueError, match=rf"^config.json {field}=.* must be a positive integer"):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"hidden_size": 30, "head_dim": None},  # an explicit head_dim (Qwen3) need not divide
            "config.json hidden_size=30 must be divisible by num_attention_heads=4",
        ),
        (
            {"num_key_value_heads": 3},
            "config.json num_attention_heads=4 must be divisible by num_key_value_heads=3",
        ),
    ],
)
def test_head_counts_must_divide(hf_dirs, changes, message):
    hf = dict(read_hf_config(hf_dirs["llama"]), **changes)
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("hidden_size", 10**9, "1000000000]"),  # in the first tensor's shape, whichever it is
        ("vocab_size", 10**12, "[1000000000000, 32]"),
        ("intermediate_size", 10**10, "10000000000"),
        ("num_hidden_layers", 3, "model.layers.2."),  # the missing layer's tensors
        ("num_hidden_layers", 10**9, "model.layers.2."),
    ],
)
def test_config_beyond_the_tensors_present_is_refused_from_the_headers(
    hf_dirs, tmp_path, monkeypatch, field, value, named
):
    bad = _variant(hf_dirs["llama"], tmp_path / "bad", config={field: value})
    monkeypatch.setattr(convert, "iter_hf_tensors", _no_tensor_data)
    with pytest.raises(ValueError) as exc:
        hf_to_dcp(bad, tmp_path / "dcp")
    _assert_one_line(exc, "config.json implies", named)
    # load_hf_model would build the model from config.json: the headers are checked first.
    monkeypatch.setattr(convert, "build_gpt_model", _no_tensor_data)
    with pytest.raises(ValueError) as exc:
        convert.load_hf_model(bad)
    _assert_one_line(exc, "config.json implies", named)


# -- files --------------------------------------------------------------------------------------
def _sharded(source: Path, out: Path, shard: str) -> Path:
    """``source``'s config.json in ``out`` with an index mapping every tensor to ``shard``."""
    out.mkdir(parents=True)
    (out / "config.json").write_text((source / "config.json").read_text())
    names = load_file(source / SINGLE_FILE)
    (out / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(names, shard)}))
    return out


@pytest.mark.parametrize("case", ["dotdot", "etc_passwd", "absolute", "index_symlink", "symlink"])
def test_shards_outside_the_model_directory_are_refused_before_opening(
    hf_dirs, tmp_path, monkeypatch, case
):
    source = hf_dirs["llama"]
    outside = tmp_path / "outside" / SINGLE_FILE  # a valid checkpoint, just not in the dir
    outside.parent.mkdir()
    outside.write_bytes((source / SINGLE_FILE).read_bytes())
    model = tmp_path / "model"
    if case == "dotdot":
        _sharded(source, model, "../outside/model.safetensors")
    elif case == "etc_passwd":
        _sharded(source, model, "../../../../../../../../etc/passwd")
    elif case == "absolute":
        _sharded(source, model, str(outside))
    elif case == "index_symlink":
        _sharded(source, model, "shard.safetensors")
        os.symlink(outside, model / "shard.safetensors")
    else:  # no index: model.safetensors itself links out
        model.mkdir()
        (model / "config.json").write_text((source / "config.json").read_text())
        os.symlink(os.path.relpath(outside, model), model / SINGLE_FILE)
    monkeypatch.setattr(convert, "_open_shard", _no_tensor_data, raising=False)
    with pytest.raises(ValueError) as exc:
        hf_to_dcp(model, tmp_path / "dcp")
    _assert_one_line(exc, "outside the model directory")
    assert not (tmp_path / "dcp").exists()


def test_a_hub_cache_snapshot_may_link_into_its_blobs(hf_dirs, tmp_path):
    # huggingface_hub's cache: snapshots/<revision>/<file> → ../../blobs/<hash>.
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_bytes((hf_dirs["llama"] / SINGLE_FILE).read_bytes())
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((hf_dirs["llama"] / "config.json").read_text())
    os.symlink("../../blobs/abc123", snapshot / SINGLE_FILE)
    assert hf_to_dcp(snapshot, tmp_path / "dcp").is_dir()


@pytest.mark.parametrize("case", ["garbage", "truncated", "second_shard"])
def test_a_corrupt_safetensors_file_is_one_line_naming_it(hf_dirs, tmp_path, case):
    source = hf_dirs["llama"]
    data = (source / SINGLE_FILE).read_bytes()
    model = tmp_path / "model"
    if case == "second_shard":  # a good first shard, then a corrupt one
        names = list(load_file(source / SINGLE_FILE))
        _sharded(source, model, "a.safetensors")
        weight_map = {n: "a.safetensors" if i < 5 else "b.safetensors" for i, n in enumerate(names)}
        (model / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
        (model / "a.safetensors").write_bytes(data)
        bad = model / "b.safetensors"
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    else:
        model.mkdir()
        (model / "config.json").write_text((source / "config.json").read_text())
        bad = model / SINGLE_FILE
        bad.write_bytes(os.urandom(64) if case == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError) as exc:
        hf_to_dcp(model, tmp_path / "dcp")
    _assert_one_line(exc, str(bad))


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("{not json", SAFETENSORS_INDEX),
        ('{"weight_map": ["model.safetensors"]}', "weight_map"),
        ('{"weight_map": {"model.norm.weight": 3}}', "weight_map"),
        ('{"weight_map": {"no.such.tensor": "model.safetensors"}}', "no.such.tensor"),
    ],
)
def test_a_malformed_index_is_one_line_naming_it(hf_dirs, tmp_path, index, message):
    model = _variant(hf_dirs["llama"], tmp_path / "model")
    (model / SAFETENSORS_INDEX).write_text(index)
    with pytest.raises(ValueError) as exc:
        hf_to_dcp(model, tmp_path / "dcp")
    _assert_one_line(exc, message)


# -- the command line ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["shape", "heads", "corrupt", "escape"])
def test_cli_reports_one_error_line_and_exit_code_2(hf_dirs, tmp_path, capsys, case):
    source = hf_dirs["llama"]
    bad = tmp_path / "bad"
    if case == "shape":
        name = "model.layers.1.self_attn.o_proj.weight"
        _variant(source, bad, tensors={name: torch.zeros(32, 16)})
    elif case == "heads":
        _variant(source, bad, config={"num_attention_heads": 0})
        name = "num_attention_heads"
    elif case == "corrupt":
        _variant(source, bad)
        (bad / SINGLE_FILE).write_bytes(b"\xff" * 32)
        name = str(bad / SINGLE_FILE)
    else:
        _sharded(source, bad, "/etc/passwd")
        name = "/etc/passwd"
    rc = convert_checkpoint.main(["hf-to-dcp", str(bad), str(tmp_path / "dcp")])
    err = capsys.readouterr().err
    assert rc == 2
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and name in errors[0], err
    assert err.rstrip().endswith(errors[0]) and "Traceback" not in err
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize(("arch", "field"), [("llama", "num_layers"), ("mixtral", "num_experts")])
def test_a_layer_count_beyond_the_checkpoints_tensors_is_refused_before_naming_them(
    hf_dirs, tmp_path, capsys, arch, field
):
    """dcp-to-hf sizes its list of tensor names from ``shared.json``'s ``num_layers`` (and
    ``num_experts``): a count the checkpoint cannot hold is refused, one line and exit 2, before
    the list is built."""
    import tracemalloc

    from tests.payload import rewrite_manifest

    step = hf_to_dcp(hf_dirs[arch], tmp_path / "dcp")
    shared = json.loads((step / "shared.json").read_text())
    shared["extra"]["config"]["model"][field] = 10**5
    (step / "shared.json").write_text(json.dumps(shared))
    rewrite_manifest(step)
    tracemalloc.start()
    try:
        code = convert_checkpoint.main(["dcp-to-hf", str(step), str(tmp_path / "hf")])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2
    assert len(errors) == 1 and errors[0].startswith(f"error: {step}: the checkpoint's config")
    assert peak < 16 << 20, peak  # 700,000 names would take about 100 MiB
