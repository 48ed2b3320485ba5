import pytest
import torch

from dist_nce.modeling.encoder import Encoder, trim_padding


def _batch(seed: int = 0, b: int = 3, t: int = 12, lengths=(12, 5, 3)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 2000, (b, t), generator=g)
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    ids[:, 0] = 101
    return ids.masked_fill(~mask, 0), mask


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    return Encoder.from_pretrained(tiny_model_dir).eval()


def test_states_shape_and_mask(encoder):
    ids, mask = _batch()
    states, out_mask = encoder(ids, mask)
    assert states.shape == (3, 12, encoder.hidden_size) == (3, 12, 32)
    assert out_mask.dtype == torch.bool and torch.equal(out_mask, mask)


def test_leading_dims_are_flattened_and_restored(encoder):
    ids, mask = _batch()
    with torch.no_grad():
        flat = encoder(ids, mask).states
        nested = encoder(ids.reshape(3, 1, 12), mask.reshape(3, 1, 12)).states
    assert nested.shape == (3, 1, 12, 32)
    torch.testing.assert_close(nested.reshape(3, 12, 32), flat)


def test_trim_padding_matches_untrimmed_on_real_tokens(encoder):
    ids, mask = _batch(lengths=(6, 5, 3))
    tids, tmask = trim_padding(ids, mask)
    assert tids.shape == (3, 6)
    with torch.no_grad():
        full = encoder(ids, mask).states
        trimmed = encoder(tids, tmask).states
    for row, n in enumerate((6, 5, 3)):
        torch.testing.assert_close(trimmed[row, :n], full[row, :n], atol=1e-5, rtol=1e-5)


def test_trim_padding_min_len_and_nested_shapes():
    mask = torch.zeros(2, 4, 10, dtype=torch.bool)
    mask[0, 1, :3] = True
    ids = torch.ones(2, 4, 10, dtype=torch.long)
    assert trim_padding(ids, mask)[0].shape == (2, 4, 3)
    assert trim_padding(ids, mask, min_len=5)[1].shape == (2, 4, 5)
    assert trim_padding(ids, mask, min_len=50)[1].shape == (2, 4, 10)
    with pytest.raises(ValueError, match=r"ids \(2, 4, 10\) and mask \(2, 10\)"):
        trim_padding(ids, mask[:, 0])


def test_pooler_frozen_rest_trainable(encoder):
    frozen = {n for n, p in encoder.named_parameters() if not p.requires_grad}
    assert frozen == {"model.pooler.dense.weight", "model.pooler.dense.bias"}


def test_from_config_plus_state_is_identical(encoder):
    clone = Encoder.from_config(encoder.config_dict()).eval()
    clone.load_state_dict(encoder.state_dict())
    ids, mask = _batch(seed=1)
    with torch.no_grad():
        torch.testing.assert_close(clone(ids, mask).states, encoder(ids, mask).states, rtol=0, atol=0)


def test_save_pretrained_loads_with_automodel(encoder, tmp_path):
    from transformers import AutoModel

    encoder.save_pretrained(tmp_path / "enc")
    plain = AutoModel.from_pretrained(tmp_path / "enc", local_files_only=True).eval()
    ids, mask = _batch(seed=2)
    with torch.no_grad():
        want = encoder(ids, mask).states
        got = plain(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope: model directory not found"):
        Encoder.from_pretrained(tmp_path / "nope")
