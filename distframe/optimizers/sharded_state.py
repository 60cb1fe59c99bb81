"""Optimizer state as parameter-range pieces, so it re-shards like the parameters.

State tensors with one value per shard element (Adam's exp_avg, exp_avg_sq, SGD's momentum: the
shard's shape, even when that is one element) become ``optim.<key>/<name>@<offset>`` pieces over
the same segments as the parameters; per-parameter scalars (Adam's step, 0-d) are kept per
parameter name; hyperparameters per group. A 0-d shard (a 0-d parameter held whole) has 0-d
state of both kinds: a key is per-element there when another shard has it per-element (or it is
complex: no optimizer counts steps in complex numbers); when no shard of the rank tells, it is
kept as a scalar, and loading reads a parameter's per-element state from its scalar when no
piece holds it (so a shard that mixes parameters still loads it; [Note: 0-dim parameters only]).
A plain torch optimizer may hold some of the shards only (fine-tuning the norms; two optimizers
over disjoint parts): it saves and loads the state of those. Pure copies; no communication.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import torch

from distframe.errors import ConfigError
from distframe.models.sharded_state import RangeReader, ShardLayout, fill_shards, piece_key, shard_pieces

_JSON_TYPES = (bool, int, float, str, type(None))

# [Note: whole-parameter state] Where each shard is one whole parameter (DDPModel's), the
# optimizer may keep state of another shape (Adafactor's row and column variances). It is saved
# as one piece of kind ``WHOLE + key`` at offset 0, by the rank that writes the parameter's first
# elements (replicated parameters are written in slices by all ranks), and
# loads only where the shard is that parameter whole again (DDP, at any world size).
WHOLE = "optim-whole."


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return None if any(i is _SKIP for i in items) else items
    return value if isinstance(value, _JSON_TYPES) else _SKIP


_SKIP = object()


# The names of the parameters a saved group trained, by which a load finds each group's settings.
TRAINED = "parameters_trained"


def hyperparameters(optimizer: torch.optim.Optimizer, layout: ShardLayout | None = None,
                    trained: list[list[str]] | None = None) -> list[dict[str, Any]]:
    """Each param group's JSON-serialisable settings (lr, betas, weight_decay, ...); given the
    ``layout`` of the shards it optimises, also the names of the parameters it trains (``TRAINED``):
    those its shards hold on this rank, or ``trained[k]`` for group k where the caller knows them
    all (a sharded optimizer's param groups span every rank)."""
    names = _shard_names(layout)
    groups = []
    for k, group in enumerate(optimizer.param_groups):
        settings = {k: _jsonable(v) for k, v in group.items() if k != "params"}
        entry = {k: v for k, v in settings.items() if v is not _SKIP}
        if trained is not None:
            entry[TRAINED] = sorted(trained[k])
        elif layout is not None:
            entry[TRAINED] = sorted({n for p in group["params"] for n in names.get(id(p), ())})
        groups.append(entry)
    return groups


def _shard_names(layout: ShardLayout | None) -> dict[int, set[str]]:
    if layout is None:
        return {}
    return {id(shard): {s.name for s in segs} for shard, segs in zip(layout.shards, layout.segments)}


def _saved_group(k: int, ours: set[str], groups: list[dict[str, Any]]) -> int | None:
    """The saved group whose settings this optimizer's group ``k`` (training ``ours``) takes:
    the one that trained its parameters (so groups built in another order still get their own),
    else the group at the same position (a checkpoint that does not name them). ConfigError when
    its parameters were trained with different settings: no one group's would be right for all."""
    matched = [i for i, saved in enumerate(groups) if ours & set(saved.get(TRAINED, ()))]
    settings = [{key: v for key, v in groups[i].items() if key != TRAINED} for i in matched]
    differing = sorted({key for s in settings[1:] for key in s if s[key] != settings[0].get(key)})
    if differing:
        shown = ", ".join(f"{key}={[s.get(key) for s in settings]}" for key in differing[:3])
        raise ConfigError(
            f"the optimizer's param group {k} trains parameters that the checkpoint's optimizer "
            f"trained in param groups {matched} with different settings ({shown}): build the "
            "optimizer with the saved run's param groups (pass the sharded optimizer an optimizer "
            "instance with them), or load the model without the optimizer")
    if matched:
        return matched[0]
    return min(k, len(groups) - 1) if groups else None


def _saved_groups(ours: list[set[str]], groups: list[dict[str, Any]]) -> list[int | None]:
    """``_saved_group`` of each group; ConfigError when groups of this optimizer that train
    parameters would take one saved group's settings: the split they make was not the saved
    run's (resuming would silently give them all one group's lr and weight decay)."""
    chosen = [_saved_group(k, names, groups) for k, names in enumerate(ours)]
    for i in set(chosen) - {None}:
        sharing = [k for k, c in enumerate(chosen) if c == i and ours[k]]
        if len(sharing) > 1:
            raise ConfigError(
                f"the optimizer's param groups {sharing} train parameters that the checkpoint's "
                f"optimizer trained in one param group ({i}; it has {len(groups)}), so loading would "
                "give them all its settings: build the optimizer with the saved run's param groups, "
                "or load the model without the optimizer (and set the groups' state afresh)")
    return chosen


def optimizer_pieces(layout: ShardLayout, optimizer: torch.optim.Optimizer, rank: int,
                     world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, list]]]:
    """(tensor pieces, scalars) for the segments this rank owns."""
    per_key: dict[str, list[torch.Tensor | None]] = {}
    scalars: dict[str, dict[str, list]] = {}
    whole: dict[str, torch.Tensor] = {}
    owned = layout.owned(rank, world_size)
    element_keys = {key for shard in layout.shards if shard.dim() > 0
                    for key, value in optimizer.state.get(shard, {}).items()
                    if isinstance(value, torch.Tensor) and value.shape == shard.shape}
    for i, shard in enumerate(layout.shards):
        if shard.numel() == 0:  # an empty ZeRO chunk (a stage with nothing to train) holds no state
            continue
        for key, value in optimizer.state.get(shard, {}).items():
            # Per-element state has the shard's shape, however few elements it has (a bias of
            # one element, a padded flat chunk of one); scalars (Adam's step) are 0-d, and so is
            # the per-element state of a 0-d parameter (Adam's exp_avg of a learned temperature).
            if isinstance(value, torch.Tensor) and value.shape == shard.shape and (
                    value.dim() > 0 or key in element_keys or value.is_complex()):
                per_key.setdefault(key, [None] * len(layout.shards))[i] = value
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and _whole_parameter(
                    shard, layout.segments[i]):
                # (before the scalars: Adafactor's row variance of a one-row matrix is (1, 1))
                for seg in owned[i]:  # the writer of its first elements: [Note: whole-parameter state]
                    if seg.param_offset == 0:
                        whole[piece_key(WHOLE + key, seg.name, 0)] = value.detach().clone()
            elif isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, numbers.Number):
                is_tensor = isinstance(value, torch.Tensor)
                entry = [float(value), str(value.dtype).removeprefix("torch.") if is_tensor else None]
                for seg in owned[i]:
                    scalars.setdefault(seg.name, {})[key] = entry
            else:
                raise ConfigError(
                    f"optimizer state {key!r} of shape {tuple(getattr(value, 'shape', ()))} is "
                    "neither per-element nor a scalar nor a tensor of one whole parameter, so it "
                    "cannot be saved; use an optimizer whose state is tensors (SGD, Adam, AdamW, "
                    "RMSprop, Adagrad; Adafactor under DDPModel)")
    pieces: dict[str, torch.Tensor] = dict(whole)
    for key, tensors in per_key.items():
        pieces.update(shard_pieces(layout, rank, world_size, f"optim.{key}", tensors))
    return pieces, scalars


def load_optimizer_pieces(layout: ShardLayout, optimizer: torch.optim.Optimizer, reader: RangeReader,
                          scalars: dict[str, dict[str, list]], groups: list[dict[str, Any]],
                          trained: list[list[str]] | None = None) -> None:
    """Rebuilds ``optimizer``'s state for the shards of this rank that it holds (a plain optimizer
    may train some of them: fine-tuning the norms) from pieces of any layout; each param group
    takes the settings of the saved one that trained its parameters (those its shards hold here,
    or ``trained[k]``: see ``hyperparameters``)."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    kinds = sorted(k for k in reader.kinds() if k.startswith("optim."))
    if not kinds and scalars and any(s.dim() > 0 and id(s) in index for s in layout.shards):
        kinds = [f"optim.{key}" for key in sorted(_probed_element_keys(optimizer, scalars))]
    state = _loaded_state(layout, index, reader, scalars, kinds)
    param_groups = []
    names = _shard_names(layout)
    ours = [set(trained[k]) if trained is not None
            else {n for p in group["params"] for n in names.get(id(p), ())}
            for k, group in enumerate(optimizer.param_groups)]
    for group, chosen in zip(optimizer.param_groups, _saved_groups(ours, groups)):
        saved = {} if chosen is None else groups[chosen]
        settings = {key: _restored(value, saved[key]) if key in saved else value
                    for key, value in group.items() if key != "params"}
        # What others put on the saved group (a scheduler's initial_lr) comes back too, as with
        # torch's load_state_dict, so a scheduler can resume with last_epoch=step - 1.
        settings.update({key: value for key, value in saved.items()
                         if key not in settings and key != TRAINED})
        param_groups.append({**settings, "params": [index[id(p)] for p in group["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def _restored(current: Any, saved: Any) -> Any:
    """A setting as ``hyperparameters`` saved it, in the form the group holds it now, as torch's
    own round trip keeps it: a one-element tensor (Adam's ``lr=torch.tensor(0.01)``, saved as its
    exact value) comes back a tensor of its dtype, shape and device (a float stepped differently:
    7e-10 off after three Adam steps), a tuple (betas, of tensors too) a tuple."""
    if isinstance(current, torch.Tensor) and current.numel() == 1 and isinstance(saved, numbers.Number):
        return torch.full_like(current, saved)
    if isinstance(current, (list, tuple)) and isinstance(saved, list) and len(current) == len(saved):
        items = [_restored(c, s) for c, s in zip(current, saved)]
        return tuple(items) if isinstance(current, tuple) else items
    return saved


def _loaded_state(layout: ShardLayout, index: dict[int, int], reader: RangeReader,
                  scalars: dict[str, dict[str, list]], kinds: list[str]) -> dict[int, dict[str, Any]]:
    """The state of each shard the optimizer holds (by its position there, ``index``), as
    ``optimizer.load_state_dict`` takes it; ``kinds``: its per-element state. ConfigError when the
    checkpoint holds state for a shard it does not hold (the saved run's optimizer trained it):
    that state would be dropped."""
    whole_kinds = sorted(k for k in reader.kinds() if k.startswith(WHOLE))
    fallback = next(iter(scalars.values()), {})
    saved = {name for name in scalars} | {s.name for shard_segs in layout.segments for s in shard_segs
                                          if any(reader.holds(kind, s.name) for kind in kinds + whole_kinds)}
    state: dict[int, dict[str, Any]] = {}
    dropped: set[str] = set()
    for shard, segs in zip(layout.shards, layout.segments):
        if id(shard) not in index:  # trainable, but not by this optimizer (as it was saved, or not)
            dropped |= {s.name for s in segs if s.name in saved}
            continue
        if (kinds or scalars) and not _saved_state_covers(segs, saved):
            continue  # state starts fresh on the parameters' first step, as with torch
        entry: dict[str, Any] = {}
        for kind in _kinds_held(kinds, segs, reader, scalars):
            tensor = torch.zeros(shard.numel(), dtype=shard.dtype, device=shard.device)
            _fill_state(tensor, segs, reader, kind, scalars)
            entry[kind.removeprefix("optim.")] = tensor.view_as(shard)
        entry.update(_whole_state(shard, segs, reader, whole_kinds))
        for key, (value, dtype) in _shard_scalars(segs, scalars, fallback, kinds).items():
            entry[key] = value if dtype is None else torch.tensor(value, dtype=getattr(torch, dtype))
        if entry:
            state[index[id(shard)]] = entry
    if dropped:
        shown = sorted(dropped)
        raise ConfigError(
            f"the checkpoint holds optimizer state for {shown[:3]}{' ...' if len(shown) > 3 else ''} "
            f"({len(shown)} parameter(s) this model trains), and the optimizer does not hold them, "
            "so loading would drop it: build the optimizer, after wrapping, over this model's "
            "parameters that the saved run's optimizer trained, freeze those it should not train "
            "(requires_grad_(False)), or load the model without the optimizer")
    return state


# [Note: 0-dim parameters only]
# Where every parameter is 0-dim (saved under DDPModel, whose shards are the parameters), all of
# the optimizer's state is 0-dim too: Adam's moments as much as its step count, so the checkpoint
# keeps them all as per-parameter scalars and holds no piece that tells which are per-element.
# Loaded into a flat shard (ZeRO, FSDP), the moments must take the shard's shape and the step
# stay 0-dim; only the optimizer knows which is which. So a throwaway instance of its class,
# over a zero tensor of two elements with a zero gradient and each group's settings, takes one
# step, and the state it makes in that tensor's shape is per-element. An optimizer that cannot
# be built from its parameters and settings alone, or stepped so, is a ConfigError.
def _probed_element_keys(optimizer: torch.optim.Optimizer, scalars: dict[str, dict[str, list]]) -> set[str]:
    """The state keys ``optimizer``'s class keeps per element: [Note: 0-dim parameters only]."""
    keys: set[str] = set()
    for group in optimizer.param_groups:
        like = next(iter(group["params"]), None)
        if like is None:
            continue
        probe = torch.zeros(2, dtype=like.dtype, device=like.device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        settings = {k: v for k, v in group.items() if k != "params"}
        try:
            twin = type(optimizer)([{**settings, "params": [probe]}])
            twin.step()
        except Exception as exc:  # noqa: BLE001 - any failure of the user's class: the fix is the same
            names = sorted(scalars)
            raise ConfigError(
                f"the checkpoint holds the optimizer state of 0-dim parameters only ({names[:3]}"
                f"{' ...' if len(names) > 3 else ''}), where per-element state (Adam's moments) and "
                "scalars (its step) are alike; telling them apart for this model's flat shards needs "
                f"{type(optimizer).__name__}(params, **settings) and one step of it, which failed "
                f"({type(exc).__name__}: {exc}): load the checkpoint under DDPModel, or load the model "
                "without the optimizer") from exc
        keys |= {key for key, value in twin.state[probe].items()
                 if isinstance(value, torch.Tensor) and value.shape == probe.shape}
    return keys


def check_state_outside_model(optimizer: torch.optim.Optimizer, model_parameters: Iterable[torch.Tensor],
                              saving: bool) -> None:
    """ConfigError when a plain ``optimizer`` holds state for a tensor that is none of
    ``model_parameters`` (the model's on this rank, frozen ones included): a learnable loss
    temperature beside ``model.parameters()``. A checkpoint keeps optimizer state by parameter
    name, so such state was dropped at save, and a load would discard what it has now, without
    a word. Such a tensor without state has nothing to lose (the parameters of the other
    pipeline stages, which an optimizer built before the pipeline wrap holds, never get any)."""
    ours = {id(p) for p in model_parameters}
    outside = [(k, p) for k, group in enumerate(optimizer.param_groups) for p in group["params"]
               if id(p) not in ours and optimizer.state.get(p)]
    if not outside:
        return
    shown = "; ".join(f"shape {tuple(p.shape)} in param group {k}" for k, p in outside[:3])
    what = ("a checkpoint cannot save it" if saving
            else "the checkpoint holds none, so loading would discard it")
    raise ConfigError(
        f"the optimizer holds state for {len(outside)} tensor(s) that are not this model's parameters "
        f"({shown}{'; ...' if len(outside) > 3 else ''}), and {what} (it keeps optimizer state by "
        "parameter name): register each on the model as an nn.Parameter of one of its modules, "
        "before wrapping it, so that it is saved with the model's")


def _whole_parameter(shard: torch.Tensor, segments: list) -> bool:
    """Whether ``shard`` is one whole parameter, in its own shape (DDP's shards)."""
    return (len(segments) == 1 and segments[0].shard_offset == 0 and segments[0].param_offset == 0
            and segments[0].length == shard.numel() and shard.dim() > 0)


def _whole_state(shard: torch.Tensor, segments: list, reader: RangeReader,
                 whole_kinds: list[str]) -> dict[str, torch.Tensor]:
    """The whole-parameter state saved for ``shard``'s parameter ([Note: whole-parameter state]);
    ConfigError when it is saved but ``shard`` is not that parameter whole."""
    found = {}
    for kind in whole_kinds:
        for seg in segments:
            if not reader.holds(kind, seg.name):
                continue
            if not _whole_parameter(shard, segments):
                raise ConfigError(
                    f"the checkpoint holds optimizer state {kind.removeprefix(WHOLE)!r} of parameter "
                    f"{seg.name!r} whole (an optimizer such as Adafactor, saved under DDPModel), but "
                    "this model's optimizer holds flat chunks of parameters; load it under DDPModel, "
                    "or load the model without the optimizer")
            found[kind.removeprefix(WHOLE)] = reader.whole(kind, seg.name).clone().to(shard.device)
    return found


def _kinds_held(kinds: list[str], segments: list, reader: RangeReader,
                scalars: dict[str, dict[str, list]]) -> list[str]:
    """The per-element state ``kinds`` saved for a shard's parameters: param groups of other
    settings keep other state (AMSGrad's max_exp_avg_sq in the groups that use it).
    A shard of padding alone takes every kind, as zeros."""
    return [kind for kind in kinds if not segments or any(
        reader.holds(kind, s.name) or kind.removeprefix("optim.") in scalars.get(s.name, {})
        for s in segments)]


def _fill_state(tensor: torch.Tensor, segments: list, reader: RangeReader, kind: str,
                scalars: dict[str, dict[str, list]]) -> None:
    """Per-element state ``kind`` of every segment: from its pieces, or from the scalar a 0-d
    parameter's state was saved as (no piece holds it)."""
    key = kind.removeprefix("optim.")
    for s in segments:
        saved = scalars.get(s.name, {}).get(key)
        if saved is not None and not reader.holds(kind, s.name):
            tensor[s.shard_offset:s.shard_offset + s.length] = saved[0]
        else:
            fill_shards(ShardLayout([tensor], [[s]]), reader, kind, [tensor])


def _shard_scalars(segments: list, scalars: dict[str, dict[str, list]], fallback: dict[str, list],
                   kinds: list[str]) -> dict[str, list]:
    """The scalar state (Adam's step) a shard takes: the one its parameters were saved with
    (leaving out a 0-d parameter's per-element state: ``kinds`` read it). ConfigError when they
    were saved with different ones (DDPModel(find_unused_parameters=True) steps a parameter only
    when it has a gradient): a shard has one, and taking any one would give the others a wrong
    bias correction, without a word. A shard of padding alone takes ``fallback``."""
    saved = {s.name: {k: v for k, v in scalars[s.name].items() if f"optim.{k}" not in kinds}
             for s in segments if s.name in scalars}
    if not saved:
        return {k: v for k, v in fallback.items() if f"optim.{k}" not in kinds}
    first_name, first = next(iter(saved.items()))
    for name, other in saved.items():
        if other != first:
            key = next(k for k in sorted(set(first) | set(other)) if first.get(k) != other.get(k))
            shown = {first_name: first.get(key, [None])[0], name: other.get(key, [None])[0]}
            raise ConfigError(
                f"the checkpoint holds different optimizer state {key!r} for parameters that this "
                f"rank's optimizer shard holds together ({shown}; a DDPModel with "
                "find_unused_parameters=True steps a parameter only when it has a gradient), but "
                "one shard keeps one value for all (one Adam step count): load the checkpoint under "
                "DDPModel (per-parameter state), or under ZeRO3Model when the parameters of each "
                "module share it (per-module state), or load the model without the optimizer")
    return first


def _saved_state_covers(segments: list, saved: set[str]) -> bool:
    """Whether a shard's state is in the checkpoint: True when every parameter of the shard has
    state there, False when none has (trained frozen, or unused, when saved). A shard mixing the
    two is a ConfigError: its one state (one Adam step count) cannot both go on and start fresh."""
    fresh = sorted({s.name for s in segments if s.name not in saved})
    if not fresh or len(fresh) == len({s.name for s in segments}):
        return not fresh
    raise ConfigError(
        f"the checkpoint holds no optimizer state for {fresh} (frozen when it was saved?), and this "
        f"rank's optimizer shard holds them with parameters whose state it continues (one Adam step "
        "count for all): load the checkpoint under a strategy with per-parameter (DDPModel) or per-module "
        "(ZeRO3Model) optimizer state, keep them frozen, or load the model without the optimizer")
