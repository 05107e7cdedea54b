"""A model ready to run: built for the runtime knobs, each sublayer bound to the implementation its
device's backend chose (dsv4.backend.bind), and loaded from a checkpoint."""
from __future__ import annotations

from typing import Sequence

from ..backend.binding import bind
from ..model.transformer import Transformer
from ..weights.checkpoint import open_checkpoint
from ..weights.config import ModelConfig
from .config import RuntimeConfig, layer_placement


def build_model(cfg: ModelConfig, rt: RuntimeConfig, placement: Sequence | None = None,
                comm=None) -> Transformer:
    """The model of cfg on rt.devices (placement: a device per layer; default all on the first),
    every sublayer bound once (rt.options, else the DSV4_* environment). Weights unloaded.
    comm: with rt.tp > 1, this rank's communicator (dsv4.parallel.Communicator): the model is
    the rank's shard (dsv4.model.sharding)."""
    model = Transformer(cfg, rt, placement, comm)
    bind(model, rt.options)
    return model


def load_model(ckpt_dir, rt: RuntimeConfig, progress: bool | None = None, comm=None):
    """Open + validate a checkpoint, place layers over rt.devices by weight bytes, build and load
    the model (with rt.tp > 1 and the rank's comm: its shard, reading only its slices).
    -> (model, checkpoint): close the checkpoint once the weights are on the devices."""
    ckpt = open_checkpoint(ckpt_dir)
    model = build_model(ckpt.config, rt, layer_placement(ckpt, rt.devices), comm)
    model.load(ckpt, progress=progress)
    return model, ckpt
