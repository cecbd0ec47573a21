"""Aux layers: which residual streams of the target feed the drafter, and how each engine numbers them.

Aux id i is the stream *entering* decoder layer i, transformers' `output_hidden_states[i]` (0 is the embedding
output, N the final pre-norm state of a target of N decoder layers). The default is [2, N//2, N-3] (a target of
fewer than 7 layers gets three other distinct ones: default_aux_layers). vLLM and speculators write the same ids;
SGLang adds 1 to each configured id, so it is given eyas id - 1 (docs/design.md, docs/serving.md).
"""
from __future__ import annotations

from .util import DAMAGED, EyasError, is_int, json_kind

FORMATS = ("sglang", "vllm")  # the engines an export writes for, each with its own id convention


def default_aux_layers(num_layers: int) -> list[int]:
    """The aux layers of a target of N = `num_layers` decoder layers unless target.aux_layers names others, three
    distinct increasing ids: EAGLE's and vLLM's [2, N//2, N-3] where those are three (N >= 7); else three spread over
    the ids the engines serve (1..N-1, see engine_aux_ids), [1, N//2, N-1] (N 4..6); else, where 1..N-1 holds
    fewer than three (N 2..3), the top three of 0..N, which eyas trains and evaluates on but export refuses."""
    n = num_layers
    if n >= 7:
        return [2, n // 2, n - 3]
    if n >= 4:
        return [1, n // 2, n - 1]
    if n >= 2:
        return [n - 2, n - 1, n]
    raise EyasError(f"a target of {n} decoder layer(s) has {max(n + 1, 0)} residual stream(s) (aux ids 0..{n}): "
                    f"too few for the 3 distinct aux layers an EAGLE-3 drafter reads")


def check_aux_layers(aux: list[int], num_layers: int) -> list[int]:
    """The user's target.aux_layers, checked against a target of `num_layers` decoder layers, in ascending order:
    the order SGLang and vLLM stack the states they capture in (their decoder loop's), so the drafter's fc is
    trained on the layout the engines serve it."""
    if len(aux) != 3:
        raise EyasError(f"target.aux_layers must name 3 layers, got {aux}")
    for a in aux:
        if not 0 <= a <= num_layers:
            raise EyasError(f"target.aux_layers: layer {a} is out of range for a target with {num_layers} "
                            f"decoder layers (valid: 0..{num_layers}, where {num_layers} is the final pre-norm state)")
    if len(set(aux)) != 3:  # the drafter's fc would read one stream twice; speculators refuses such a config too
        raise EyasError(f"target.aux_layers: {aux} names a layer twice; name 3 distinct layers")
    return sorted(aux)


def check_drafter_aux_layers(aux, where, target=None, field: str = "") -> list[int]:
    """The aux layers a drafter's config records (eyas ids), checked where they are read: three layer ids, and with
    `target`, three layers that target has. Refused naming the drafter's file (and `field`, where it says them):
    these come from the drafter, which was trained on them, not from the user's target.aux_layers."""
    what = f"the drafter's aux layers ({field})" if field else "the drafter's aux layers"
    if not isinstance(aux, list) or not all(is_int(a) for a in aux):
        raise EyasError(f"{where}: {what} must be a list of layer ids, got {json_kind(aux)}; {DAMAGED}")
    n = getattr(target, "num_layers", None)
    if len(aux) != 3:
        ids = f"of target '{target.name}', ids 0..{n}" if n is not None else "of the target"
        raise EyasError(f"{where}: {what} are {aux}, {len(aux)} layer(s); an EAGLE-3 drafter is fed the target's "
                        f"states at 3 layers {ids} (its fc reads 3 x the target's hidden size). The file is damaged "
                        f"or not an eyas drafter's: {DAMAGED}")
    if any(a < 0 for a in aux):
        raise EyasError(f"{where}: {what} are {aux}: a layer id is 0 or more; {DAMAGED}")
    for a in aux:
        if n is not None and a > n:
            raise EyasError(f"{where}: {what} are {aux}: target '{target.name}' has no layer {a} (its {n} decoder "
                            f"layers take ids 0..{n}), so the drafter was trained for another target. Name that one "
                            f"(--target), or train a drafter for this one")
    return list(aux)


def engine_aux_ids(aux_layers: list[int], fmt: str, num_layers: int = 0) -> list[int]:
    """The ids to write into an engine's config so that it captures the same residual streams the
    drafter was trained on (eyas id i = the stream entering decoder layer i = HF hidden_states[i])."""
    check_format(fmt)
    if list(aux_layers) != sorted(aux_layers):
        raise EyasError(f"aux layers {list(aux_layers)} are not in ascending order: SGLang and vLLM stack the states "
                        f"they capture in layer order, so a drafter trained on another order would read them "
                        f"shuffled; retrain with target.aux_layers {sorted(aux_layers)}")
    for a in aux_layers:
        # both engines capture inside their decoder loop, before layer i runs, and add the
        # residual there: the embedding output (i=0) and the final pre-norm state (i=N) are not reachable
        if a < 1 or (num_layers and a >= num_layers):
            raise EyasError(f"aux layer {a} cannot be served: SGLang and vLLM capture the stream entering "
                            f"decoder layers 1..{num_layers - 1 if num_layers else 'N-1'}; "
                            f"retrain with target.aux_layers inside that range")
    return [a - 1 for a in aux_layers] if fmt == "sglang" else list(aux_layers)


def eyas_aux_ids(ids: list[int], fmt: str) -> list[int]:
    """Inverse of engine_aux_ids."""
    check_format(fmt)
    return [int(i) + 1 for i in ids] if fmt == "sglang" else [int(i) for i in ids]


def config_aux_ids(raw: dict) -> list[int] | None:
    """The aux layers (eyas ids) an engine-format drafter config records: SGLang's nested
    `eagle_config["eagle_aux_hidden_state_layer_ids"]`, else a top-level `eagle_aux_hidden_state_layer_ids`, read as
    vLLM reads it (as-is); None where it records none, or ids that are not a list of whole numbers (import_drafter
    refuses those, naming the field)."""
    nested = raw.get("eagle_config")
    nested = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
    if nested:
        return eyas_aux_ids(nested, "sglang") if int_list(nested) else None
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    return eyas_aux_ids(top, "vllm") if top and int_list(top) else None


def int_list(v) -> bool:
    return isinstance(v, list) and all(is_int(i) for i in v)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise EyasError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")
