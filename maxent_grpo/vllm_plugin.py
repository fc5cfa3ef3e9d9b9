"""Two weight-transfer backends for ``vllm serve``, ``maxent_file`` (the weights through a
file) and ``maxent_gloo`` (by broadcast over TCP): the ways
:class:`~maxent_grpo.rollout.vllm_server.VLLMServerEngine` updates a server on a machine
without a GPU (vLLM's own backends, NCCL and CUDA IPC, need one).

vLLM loads this module in each of its processes through the ``vllm.general_plugins`` entry
point that ``pip install maxent-grpo`` declares (``pyproject.toml``); :func:`register` adds
the backend ``maxent_file`` to vLLM's registry, and a server started with
``--weight-transfer-config '{"backend": "maxent_file"}'`` uses it. The protocol is vLLM's
own, driven over HTTP by the trainer:

1. ``POST /init_weight_transfer_engine {"init_info": {}}`` once;
2. per update: ``/start_weight_update``; ``/update_weights {"update_info": {"path": F,
   "num_tensors": n, "num_bytes": b}}`` for a safetensors file ``F`` the trainer wrote
   where the server can read it (``/dev/shm`` on one machine, a shared file system across
   machines); ``/finish_weight_update {"weight_version": v}``.

The update checks the file against what the trainer says it wrote (the tensor count and
the file's size) before loading a single tensor, so a file cut short is refused whole; the
trainer then repeats the transfer from the start. After loading, every parameter of the
served model as it was built must have received a tensor (the names vLLM's model loader
reports), or the update fails naming the parameters left out: a model would otherwise keep
old weights in them with nothing but a log line. The check is per parameter: a stacked
parameter (``qkv_proj``, ``gate_up_proj``) counts as received when any of its shards came.
It also registers ``maxent_gloo``: the same protocol as vLLM's NCCL backend over a gloo
process group on the CPU (its messages: ``GlooInitInfo`` and ``GlooUpdateInfo`` below; the
trainer's side: :mod:`maxent_grpo.rollout.server_transfer`), with the same completeness check.

The module imports nothing heavy at the top: vLLM's processes import it at start-up.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

BACKEND = "maxent_file"
GLOO_BACKEND = "maxent_gloo"


def register() -> None:
    """Add the ``maxent_file`` and ``maxent_gloo`` backends to vLLM's weight-transfer
    registry (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in ((BACKEND, "FileWeightTransfer"), (GLOO_BACKEND, "GlooWeightTransfer")):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, __name__, cls)


def _check_loaded(engine, expected: set[str], loaded, source: str) -> None:
    """Every parameter of the served model as it was built received a tensor, else the
    reload is closed (the server stays out of use until a whole update lands) and the
    update fails naming the parameters left out."""
    if loaded is None:  # a model that does not report the names it loaded
        return
    missing = sorted(expected - set(loaded))
    if missing:
        with contextlib.suppress(Exception):  # the names are the error to report
            engine.finish_weight_update()
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise ValueError(
            f"{source} left {len(missing)} parameters of the served model without new "
            f"weights ({shown}): the trainer's tensor names do not cover this model's")


def _engine_class():
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class FileInitInfo(WeightTransferInitInfo):
        """No settings: the file's path comes with each update."""

    @dataclass
    class FileUpdateInfo(WeightTransferUpdateInfo):
        """One safetensors file holding every tensor of the model (checkpoint names)."""

        path: str
        num_tensors: int
        num_bytes: int

    class FileWeightTransfer(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
        """Loads a whole checkpoint from one safetensors file, through vLLM's layer-wise
        reload (the path its NCCL backend takes), after checking the file is complete."""

        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: FileInitInfo) -> None:
            pass

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: FileUpdateInfo) -> None:
            from safetensors import safe_open

            path = update_info.path
            # the parameters as the model was built (later processing, e.g. online
            # quantization, adds its own): each must receive a tensor from the file
            expected = {n for n, _ in self.model.named_parameters()}
            if not os.path.isfile(path):
                raise ValueError(f"maxent_file: no weights file at {path}")
            size = os.path.getsize(path)
            if size != update_info.num_bytes:
                raise ValueError(f"maxent_file: {path} has {size} bytes; the trainer wrote "
                                 f"{update_info.num_bytes} (a file cut short?)")
            with safe_open(path, framework="pt", device="cpu") as f:
                names = list(f.keys())
                if len(names) != update_info.num_tensors:
                    raise ValueError(f"maxent_file: {path} holds {len(names)} tensors; the "
                                     f"trainer wrote {update_info.num_tensors}")
                loaded = self.model.load_weights((name, f.get_tensor(name)) for name in names)
            _check_loaded(self, expected, loaded, f"maxent_file: {path}")

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        """Where the trainer's rank 0 waits, and this server's first rank in the group."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_seconds: float = 300.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        """Every tensor of the update, in the order they are broadcast."""

        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

        def __post_init__(self) -> None:
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError("maxent_gloo: names, dtype_names and shapes differ in length")

    class GlooWeightTransfer(FileWeightTransfer):
        """Receives every tensor by broadcast from the trainer's rank 0 over gloo, through
        the same layer-wise reload and completeness check as ``maxent_file``."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        group = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            from maxent_grpo.rollout.server_transfer import gloo_group

            parallel = self.parallel_config  # this worker's place, as vLLM's NCCL backend
            rank = (parallel.data_parallel_index * parallel.world_size + parallel.rank
                    + init_info.rank_offset)
            self.group = gloo_group(init_info.master_address, init_info.master_port, rank,
                                    init_info.world_size, init_info.timeout_seconds)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            import torch

            if self.group is None:
                raise RuntimeError("maxent_gloo: /init_weight_transfer_engine first")
            expected = {n for n, _ in self.model.named_parameters()}
            loaded: set[str] | None = set()
            try:
                for name, dtype, shape in zip(update_info.names, update_info.dtype_names,
                                              update_info.shapes, strict=True):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                    self.group.broadcast(tensor, 0).wait()
                    names = self.model.load_weights([(name, tensor.to(self.device))])
                    loaded = None if names is None or loaded is None else loaded | set(names)
            except BaseException:
                # a broadcast cut short: close the reload, so that no half-received layer
                # is carried into the next update (the server stays out of use until then)
                self.group = None
                with contextlib.suppress(Exception):  # the broadcast's error is the one
                    self.finish_weight_update()
                raise
            _check_loaded(self, expected, loaded, "maxent_gloo: the update")

        def shutdown(self) -> None:
            self.group = None

    return {"FileWeightTransfer": FileWeightTransfer, "GlooWeightTransfer": GlooWeightTransfer}


def __getattr__(name: str):
    # vLLM's registry imports ``FileWeightTransfer`` (``GlooWeightTransfer``) from this module
    # by name; the classes are built on first use so that importing the module never imports vLLM.
    if name in ("FileWeightTransfer", "GlooWeightTransfer"):
        classes = _engine_class()
        globals().update(classes)
        return classes[name]
    raise AttributeError(name)
