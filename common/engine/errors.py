"""Errors the engine's input paths raise, in a module of their own: the planner's simulator and the
gateway's admission read them without the processor's transformers and torch."""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input (an undecodable image, a prompt the model cannot take); maps to a 4xx."""
