"""A checkpoint of a model with tied weights (the LM's head.weight is its tok_embedding.weight)
stores the tensor once and records the other name as an alias; a model that unties them reads
the alias from the tensor it names, as torch's load_state_dict of the same state dict does."""
import pytest
import torch

from distframe import checkpoint
from distframe.launch import spawn
from tests.models.common import STRATEGIES, lm_loss, tiny_lm


def _save_tied(path, strategy="ddp"):
    def save(backend):
        model = STRATEGIES[strategy][0](tiny_lm(tie=True), backend)
        checkpoint.save(path, model, step=1)
    spawn(save, 2, timeout=30)


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_a_tied_checkpoint_loads_into_an_untied_model(tmp_path, strategy):
    path = tmp_path / "tied"
    _save_tied(path)
    saved = checkpoint.consolidate(path)

    def load(backend):
        model = STRATEGIES[strategy][0](tiny_lm(tie=False, seed=7), backend)
        checkpoint.load(path, model)
        return model.gather_full_parameters()
    for loaded in spawn(load, 2, timeout=30):
        assert set(loaded) == set(saved)
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
        # the untied copies are two tensors now, equal where the checkpoint held one
        assert loaded["head.weight"].data_ptr() != loaded["tok_embedding.weight"].data_ptr()


def test_an_untied_model_of_another_shape_is_still_refused_naming_the_alias(tmp_path):
    """The alias reads the tensor it names: where the shapes differ, the error says which."""
    path = tmp_path / "tied"
    _save_tied(path)

    def load(backend):
        lm = tiny_lm(tie=False)
        lm.head = torch.nn.Linear(16, 3, bias=False).double()  # not the embedding's shape
        with pytest.raises(checkpoint.CheckpointError, match="'head.weight'.*'tok_embedding.weight'"):
            checkpoint.load(path, STRATEGIES["ddp"][0](lm, backend))
    spawn(load, 1, timeout=30)


def test_the_optimizer_state_of_the_tied_weight_goes_to_both_untied_copies(tmp_path):
    """Both copies continue from the history the one tied weight had (Adam's moments and step)."""
    path = tmp_path / "tied"
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def save(backend):
        model = STRATEGIES["ddp"][0](tiny_lm(tie=True), backend)
        opt = STRATEGIES["ddp"][1](model, torch.optim.Adam, lr=1e-2)
        model.train_step((tokens, tokens), lm_loss, opt)
        checkpoint.save(path, model, opt, step=1)
        return {k: v.clone() for k, v in opt.wrapped_optimizer.state[model.wrapped_model.head.weight].items()}

    def load(backend):
        model = STRATEGIES["ddp"][0](tiny_lm(tie=False, seed=7), backend)
        opt = STRATEGIES["ddp"][1](model, torch.optim.Adam, lr=1e-2)
        checkpoint.load(path, model, opt)
        lm = model.wrapped_model
        return [opt.wrapped_optimizer.state[p] for p in (lm.head.weight, lm.tok_embedding.weight)]
    tied = spawn(save, 1, timeout=30)[0]
    for state in spawn(load, 1, timeout=30)[0]:
        for key, value in tied.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0)
