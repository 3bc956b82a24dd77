"""Helpers shared by the patches."""

from __future__ import annotations


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers (each keeps it in ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model
