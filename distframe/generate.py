"""``distframe generate``: sample text from a checkpoint that ``distframe train`` wrote.

The checkpoint is consolidated into a plain state dict (any strategy, any world size) and loaded
into a single-process DilatedTransformerLM whose shape comes from the model configuration saved
in the checkpoint (older checkpoints: their run's OUT/config.json). Tokens are bytes: the command
writes them to stdout as they are; ``generate_text`` decodes them as UTF-8 (invalid bytes replaced).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from attention.model import DilatedTransformerConfig, DilatedTransformerLM
from distframe import train_checkpoint
from distframe.errors import ConfigError
from distframe.train_config_checks import check_utf8_path


_RESTORE = "restore it from the run that wrote the checkpoint"


def load_model(path: str) -> DilatedTransformerLM:
    """The trained model of checkpoint ``path`` (or of the latest checkpoint of a run's OUT)."""
    from distframe import checkpoint
    path = resolve_checkpoint(path)
    config, source = saved_model_config(path)
    model = DilatedTransformerLM(config)
    try:
        state = checkpoint.consolidate(path)
    except checkpoint.CheckpointError as exc:
        damage = train_checkpoint.damaged(path)
        if damage is None:  # intact: the error says what else is wrong
            raise
        raise checkpoint.CheckpointError(train_checkpoint.damaged_for_generate(path, damage)) from exc
    if model.config.tie_embeddings:  # a tied head is one parameter, saved once
        state.setdefault("head.weight", state["tok_embedding.weight"])
    _check_shapes(model, state, path, source)
    model.to(state["tok_embedding.weight"].dtype)
    model.load_state_dict(state)
    return model.eval()


def saved_model_config(path: str) -> tuple[DilatedTransformerConfig, str]:
    """The model shape saved with checkpoint ``path`` ("model" of the run's configuration, read
    from the checkpoint itself or, for checkpoints saved without it, ``OUT/config.json``) and the
    file it came from; ConfigError naming the file and the key where it is not what distframe
    train writes."""
    info, source = train_checkpoint.saved_run_info(path)
    shape = info.get("model")
    if not isinstance(shape, dict):
        held = "no" if shape is None else f"a {type(shape).__name__} as its"
        raise ConfigError(f'{source} holds {held} "model" (the model shape); {_RESTORE}')
    defaults = {f.name: f.default for f in dataclasses.fields(DilatedTransformerConfig)}
    for key, value in shape.items():
        if key not in defaults:
            raise ConfigError(f"{source}: unknown model key {key!r} (the keys are "
                              f"{', '.join(defaults)}); {_RESTORE}")
        expected = _unlike(value, defaults[key])
        if expected:
            raise ConfigError(f"{source}: model key {key!r} holds {value!r}, not {expected}; "
                              f"{_RESTORE}")
    try:
        return DilatedTransformerConfig(**shape), source
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}; {_RESTORE}") from None


def _unlike(value: object, default: object) -> str | None:
    """What ``value`` should be to have the type of its field's ``default``; None if it has."""
    def integer(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        return None if integer(value) else "an integer"
    if isinstance(default, float):
        return None if integer(value) or isinstance(value, float) else "a number"
    ok = isinstance(value, list) and all(integer(v) for v in value)
    return None if ok else "a list of integers"


def _check_shapes(model: DilatedTransformerLM, state: dict[str, torch.Tensor], path: str,
                  source: str) -> None:
    """ConfigError naming ``source`` (where the model shape was read) where its model shape is
    not the one checkpoint ``path`` holds (a value edited by hand, or config.json of another run)."""
    ours = {name: list(t.shape) for name, t in model.state_dict().items()}
    saved = {name: list(t.shape) for name, t in state.items()}
    for name in sorted(set(ours) | set(saved)):
        if ours.get(name) != saved.get(name):
            raise ConfigError(
                f"{source}: its \"model\" gives {name!r} the shape "
                f"{ours.get(name, 'none')} but checkpoint {path} holds {saved.get(name, 'none')}; "
                f"{_RESTORE}")


def resolve_checkpoint(path: str) -> str:
    check_utf8_path("--checkpoint", path)
    if os.path.exists(os.path.join(path, "metadata.json")):
        return path
    found = train_checkpoint.latest_checkpoint(path)
    if found is None:
        raise ConfigError(f"--checkpoint {path}: not a checkpoint (no metadata.json) nor a run "
                          "directory with checkpoints/step-N; pass OUT/checkpoints/step-N of a "
                          "distframe train run")
    return found[0]


@torch.no_grad()
def sample(model: DilatedTransformerLM, prompt: bytes, *, max_new_tokens: int,
           temperature: float, top_k: int, seed: int) -> bytes:
    """``prompt`` and its continuation by ``max_new_tokens`` tokens (the last ``seq_len`` as
    context). An empty prompt is continued from a newline byte (the model needs one token to
    condition on; a newline is where a text file's lines start), which is not returned."""
    if max_new_tokens < 0 or not temperature >= 0 or top_k < 0:  # `not >=`: NaN is refused too
        raise ConfigError(f"--tokens, --temperature and --top-k must be numbers >= 0, got "
                          f"{max_new_tokens}, {temperature}, {top_k}")
    if not -2 ** 63 <= seed < 2 ** 64:  # what torch.Generator.manual_seed takes
        raise ConfigError(f"--seed {seed}: use an integer in [-2**63, 2**64)")
    generator = torch.Generator().manual_seed(seed)
    seed_tokens = 0 if prompt else 1
    tokens = list(prompt) or [ord("\n")]
    vocab = model.config.vocab_size
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-model.config.seq_len:]], dtype=torch.int64)
        logits = model(context)[0, -1].double()  # (vocab,)
        if temperature == 0:
            tokens.append(int(logits.argmax()))
            continue
        # Shifted first so that the largest is 0: a tiny temperature then gives -inf for the
        # others (greedy), where dividing first overflowed to inf and softmax gave NaN.
        logits = (logits - logits.max()) / temperature
        if 0 < top_k < vocab:
            threshold = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return bytes(t % 256 for t in tokens[seed_tokens:])


def generate_bytes(path: str, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
                   top_k: int = 40, seed: int = 0) -> bytes:
    """The prompt's bytes and their continuation sampled from the checkpoint at ``path`` (an
    empty prompt: the continuation only, see :func:`sample`)."""
    model = load_model(path)
    if model.config.vocab_size != 256:
        raise ConfigError("this checkpoint was trained on a uint16 token file; generate samples "
                          "byte-level models (trained on text) only")
    # A command-line byte that is not UTF-8 reaches Python as a surrogate escape (PEP 383):
    # hand the model that byte, as it is a byte-level model.
    prompt_bytes = prompt.encode("utf-8", errors="surrogateescape")
    return sample(model, prompt_bytes, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_k=top_k, seed=seed)


def generate_text(path: str, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int = 40, seed: int = 0) -> str:
    """:func:`generate_bytes` decoded as UTF-8, bytes that are not UTF-8 replaced (U+FFFD)."""
    out = generate_bytes(path, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                         top_k=top_k, seed=seed)
    return out.decode("utf-8", errors="replace")
