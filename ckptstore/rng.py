"""The random number generators of a process as one stateful value of a training state."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


class RNGState:
    """Python's ``random``, numpy's global generator, torch's CPU generator and the generator
    of every CUDA device, captured by ``state_dict()`` (at ``save()``) and restored by
    ``load_state_dict()`` (at ``load()``)::

        state = {"model": model, "optim": opt, "rng": ckptstore.RNGState()}

    A run resumed from the step then draws the same random numbers as one that never stopped
    (dropout masks, data shuffles, sampling). ``torch.Generator`` objects of your own go into
    the state as they are."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(tuple(state["numpy"]))
        torch.set_rng_state(state["torch"])
        saved = list(state.get("cuda") or [])
        here = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if saved and len(saved) != here:
            logger.warning(
                "RNGState: %d CUDA generator(s) saved, %d device(s) here: the first %d restored",
                len(saved),
                here,
                min(len(saved), here),
            )
        for device, rng in enumerate(saved[:here]):
            torch.cuda.set_rng_state(rng, device)
