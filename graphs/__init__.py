"""Model-agnostic CUDA-graph decode runtime: segments over static buffers, captured per segment or
per device, replayed step by step (never imports a model package; see docs/EMBEDDING.md).
"""
from graphs.buffers import BufferSpec, LiveBuffers, StaticInputs, allocate_all
from graphs.capture import find_host_syncs
from graphs.decoder import CUDAGraphDecoder
from graphs.errors import (BufferError, CaptureError, ConfigError, DebugPointerError, GraphError,
                           LifecycleError, ModeError, PlanError, ReplayError)
from graphs.placement import Handoff, Plan, Segment, balanced_placement, plan_handoffs

__all__ = [
    "BufferError", "BufferSpec", "CUDAGraphDecoder", "CaptureError", "ConfigError",
    "DebugPointerError", "GraphError", "Handoff", "LifecycleError", "LiveBuffers", "ModeError",
    "Plan", "PlanError", "ReplayError", "Segment", "StaticInputs", "allocate_all",
    "balanced_placement", "find_host_syncs", "plan_handoffs",
]
