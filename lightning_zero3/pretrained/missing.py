"""Tensors a checkpoint lacks, in a model built on the meta device: given what ``from_pretrained`` gives them.

transformers' ``from_pretrained`` builds on the meta device, marks every tensor it loaded
``_is_hf_initialized`` and then runs the model's ``initialize_weights()``, whose ``_init_weights`` skips
marked tensors: only the missing ones are drawn (a new head, new embedding rows), nothing else. A model
built by ``from_config`` under zero3 and claimed by ``load_pretrained`` while its draws still wait gets the
same (see [Note: draws wait for a load] in engine/layout/materialize.py): its construction is forgotten,
the loaded tensors are marked, and the model's own ``initialize_weights()`` runs on the meta model, its
ops recorded for the engine to replay into the shards and its draws made now, where from_pretrained
makes them. A model that is not a Hugging Face one keeps its construction for the tensors it lacks.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Collection, Iterator

from torch import nn

from ..engine.layout.materialize import draws_settled, undecided

INITIALISED = "_is_hf_initialized"  # transformers' mark of a module or tensor that needs no init


def hugging_face_models(root: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models inside ``root`` (``root`` itself, or the base of a PeftModel)."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found: list[nn.Module] = []
    inner: set[int] = set()
    for module in root.modules():
        if isinstance(module, PreTrainedModel) and id(module) not in inner:
            found.append(module)
            inner.update(id(m) for m in module.modules())
    return found


@contextmanager
def loaded_as_from_pretrained(
    root: nn.Module, loaded_params: Collection[int], loaded_buffers: Collection[tuple[int, str]], adapter: bool
) -> Iterator[None]:  # fmt: skip
    """``root``'s waiting draws settled for a load of ``loaded_params`` (ids) and ``loaded_buffers``
    ((id of module, name)): see the module docstring. ``adapter``: a LoRA adapter's load, which leaves the
    base model as it is."""
    params = {id(p): p for p in root.parameters()}
    loaded = [params[i] for i in loaded_params if i in params]
    models = [] if adapter else [m for m in hugging_face_models(root) if all(undecided(p) for p in m.parameters())]
    fresh = [p for m in models for p in m.parameters() if id(p) not in loaded_params]
    with draws_settled(loaded, fresh):
        for model in models:
            _initialise_missing(model, set(loaded_params), set(loaded_buffers))
        yield


def _initialise_missing(model: nn.Module, loaded_params: set[int], loaded_buffers: set[tuple[int, str]]) -> None:
    for module in model.modules():
        module.__dict__.pop(INITIALISED, None)  # set by post_init in from_config: nothing is initialised yet
        for p in module._parameters.values():
            if p is not None and id(p) in loaded_params:
                setattr(p, INITIALISED, True)
        for name, b in module._buffers.items():
            if b is not None and (id(module), name) in loaded_buffers:
                setattr(b, INITIALISED, True)
    if hasattr(model, "initialize_weights"):
        model.initialize_weights()
        return
    for module in model.modules():  # older transformers: only the modules that miss a tensor
        if any(p is not None and id(p) not in loaded_params for p in module._parameters.values()):
            model._init_weights(module)
