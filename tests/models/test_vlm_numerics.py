"""Qwen2.5-VL on Megatron-core (language model with MRoPE + transformers' vision tower, loaded through the layout
tables) gives transformers' `Qwen2_5_VLForConditionalGeneration` logits on rows with images of different sizes,
float32 within 1e-4 relative, at TP1, TP2 and PP2 (the vision tower on the first stage only, MRoPE positions on both); our MRoPE position ids equal transformers' get_rope_index."""
import pytest
import torch

from mtrain.dist import run_on_ranks
from mtrain.models.mrope import ImageTokenError, mrope_position_ids

from vlm_reference import hf_vlm, image_batch


def _megatron_logits(rank, world, cfg, state, par, tokens, pixels, grid, positions):
    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models import build_model, forward_logits
    from mtrain.reshard.megatron_side import load_hf_into_megatron
    init_distributed(**par)
    chunks, _ = build_model(cfg, params_dtype=torch.float32)
    load_hf_into_megatron(model_layout(cfg), chunks, lambda n: state[n], rank)
    out = forward_logits(chunks, tokens, position_ids=positions,
                         images={"pixel_values": pixels, "image_grid_thw": grid})
    return None if out is None else out.detach()


@pytest.mark.parametrize("par, world", [(dict(tp=1), 1), (dict(tp=2), 2),
                                        pytest.param(dict(pp=2), 2, marks=pytest.mark.slow)],  # PP: also the loop test
                         ids=["tp1", "tp2", "pp2"])
def test_megatron_vlm_logits_equal_transformers(par, world):
    cfg, model, state = hf_vlm()
    tokens, pixels, grid, token_types = image_batch(cfg)
    with torch.no_grad():
        want = model(input_ids=tokens, pixel_values=pixels, image_grid_thw=grid,
                     mm_token_type_ids=token_types).logits.float()
    positions = mrope_position_ids(tokens, grid, cfg["image_token_id"], cfg["vision_config"]["spatial_merge_size"])
    outs = run_on_ranks(_megatron_logits, world, cfg, state, par, tokens, pixels, grid, positions, timeout=600)
    got = [o for o in outs if o is not None]
    assert got
    for g in got:
        assert g.shape == want.shape
        err = (g - want).abs().max() / want.abs().max()
        assert err < 1e-4, f"{par}: max relative logit error {err:.2e}"


def test_mrope_position_ids_equal_transformers_get_rope_index():
    cfg, model, _ = hf_vlm()
    for grids in ([[(1, 4, 6)], [(1, 8, 4), (1, 4, 4)]], [[(1, 2, 2), (1, 6, 2)], []], [[(1, 10, 2)], [(1, 2, 8)]]):
        tokens, _, grid, token_types = image_batch(cfg, grids=grids)
        want, _ = model.model.get_rope_index(tokens, mm_token_type_ids=token_types, image_grid_thw=grid)
        assert torch.equal(mrope_position_ids(tokens, grid, cfg["image_token_id"], 2), want), grids


def test_mrope_position_ids_refuse_placeholders_and_grids_that_disagree():
    cfg, _, _ = hf_vlm()
    tokens, _, grid, _ = image_batch(cfg)
    with pytest.raises(ImageTokenError, match="only 2 image grid"):
        mrope_position_ids(tokens, grid[:2], cfg["image_token_id"], 2)
    with pytest.raises(ImageTokenError, match="4 image grid"):
        mrope_position_ids(tokens, torch.cat([grid, grid[:1]]), cfg["image_token_id"], 2)
    with pytest.raises(ImageTokenError, match="needs 16 placeholder"):
        mrope_position_ids(tokens, torch.tensor([[1, 8, 8], [1, 8, 4], [1, 4, 4]]), cfg["image_token_id"], 2)


def test_generated_placeholder_ids_are_text():
    """A response may sample the placeholder id; engines embed it as text at the next text position."""
    cfg, model, _ = hf_vlm()
    tokens, _, grid, token_types = image_batch(cfg, grids=[[(1, 4, 6)]])
    prompt_len = tokens.shape[1]
    tokens = torch.cat([tokens, torch.tensor([[cfg["image_token_id"], 5, cfg["image_token_id"]]])], dim=1)
    pos = mrope_position_ids(tokens, grid, cfg["image_token_id"], 2, prompt_lens=[prompt_len])
    want, _ = model.model.get_rope_index(tokens[:, :prompt_len], mm_token_type_ids=token_types, image_grid_thw=grid)
    assert torch.equal(pos[:, :, :prompt_len], want)
    last = int(want[0, 0, -1])
    assert pos[:, 0, prompt_len:].tolist() == [[last + 1, last + 2, last + 3]] * 3
    with pytest.raises(ImageTokenError):  # without prompt_lens the generated ids would be taken for an image
        mrope_position_ids(tokens, grid, cfg["image_token_id"], 2)


def test_image_scatter_under_sequence_parallelism_is_the_slice_of_the_full_one():
    """Each sequence-parallel rank replaces its own slice's placeholders with the right image rows (the CPU local
    spec cannot run sequence parallelism end to end: its norms refuse it)."""
    from mtrain.models.vlm import scatter_images
    g = torch.Generator().manual_seed(0)
    b, s, h = 2, 12, 5
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[0, 2:7] = True
    mask[1, 5:11] = True
    text = torch.randn(s, b, h, generator=g)
    images = torch.randn(int(mask.sum()), h, generator=g)
    full = scatter_images(text, images, mask)
    want = text.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), images).transpose(0, 1)  # transformers' way
    assert torch.equal(full, want)
    for sp in (2, 3, 4):
        n = s // sp
        parts = [scatter_images(text[r * n:(r + 1) * n], images, mask, r, sp) for r in range(sp)]
        assert torch.equal(torch.cat(parts), full), sp
