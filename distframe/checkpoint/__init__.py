"""Sharded checkpoints: ``save``, ``load`` (re-sharding to any world size and data-parallel
strategy) and ``consolidate`` (a plain state dict). See ``distframe.checkpoint.format``."""
from distframe.checkpoint.format import CheckpointError
from distframe.checkpoint.io import complete_checkpoints, consolidate, latest_step, load, save

__all__ = ["CheckpointError", "complete_checkpoints", "consolidate", "latest_step", "load", "save"]
