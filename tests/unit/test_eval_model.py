"""Model resolution for eval and the engines (``models.resolve.as_hf_dir``): HF directories pass through, Megatron checkpoints are converted to a
temporary HF directory (weights identical, removed afterwards), anything else is refused."""

import pytest

from megatron_gtpo.models.resolve import as_hf_dir, is_megatron_checkpoint
from megatron_gtpo.utils.configuration import ConfigError
from tests.tiny_hf import save_tiny_hf_model


def _tensors(directory):
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_megatron_checkpoint_is_converted_for_eval(tmp_path):
    import torch

    from megatron_gtpo.cli.convert import main as convert

    hf = save_tiny_hf_model("qwen2", tmp_path / "hf")
    mcore = tmp_path / "mcore"
    assert convert(["--to", "megatron", "--input", str(hf), "--output", str(mcore)]) == 0
    assert is_megatron_checkpoint(mcore) and not is_megatron_checkpoint(hf)
    with as_hf_dir(str(hf)) as same:
        assert same == hf
    with as_hf_dir(str(mcore)) as converted:
        assert (converted / "config.json").is_file()
        original, roundtrip = _tensors(hf), _tensors(converted)
        assert original.keys() == roundtrip.keys()
        assert all(torch.equal(original[k], roundtrip[k]) for k in original)
    assert not converted.exists()  # the temporary HF copy is removed after the evaluation


def test_unusable_model_paths_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(ConfigError, match="neither an HF model directory"):
            with as_hf_dir(str(path)):
                pass
