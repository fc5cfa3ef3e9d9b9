"""The collective weight transfers of the server engine: the weights broadcast from the
trainer's rank 0 to a server's workers, with no file in between.

``VLLMServerEngine(weight_transfer=...)`` picks the transport:

- ``"file"`` (the default): one safetensors file per update, read by the servers
  (:mod:`maxent_grpo.vllm_plugin`'s ``maxent_file`` backend). No extra process group; the
  servers must see the trainer's ``transfer_dir``.
- ``"nccl"``: vLLM's own NCCL backend, for GPU servers (started with
  ``--weight-transfer-config '{"backend": "nccl"}'``): rank 0's GPU broadcasts each tensor
  to the server's workers. The trainer side is vLLM's
  ``NCCLTrainerWeightTransferEngine``, so the training environment needs ``vllm`` too.
- ``"gloo"``: the same two-sided protocol over a gloo process group on the CPU
  (``maxent_gloo``, registered by :mod:`maxent_grpo.vllm_plugin`): servers on other
  machines without a shared file system or a GPU, and the tests of this path on the CPU.

For the two collective transports, each server gets its own process group: the trainer's
rank 0 at rank 0 (it hosts the rendezvous on a free port of ``transfer_address``) and the
server's workers after it (as many as its ``/get_world_size`` says). The trainer starts
it by asking the server to join (``/init_weight_transfer_engine``, which returns only once
both sides met); an update is ``/start_weight_update``, ``/update_weights`` with every
tensor's name, dtype and shape (answered once the server received them all) while rank 0
broadcasts them in that order, then ``/finish_weight_update``. A transfer that fails
leaves the group unusable and the server possibly half-updated: that server is left paused
and out of use, and the next step forms a new group with it once it answers (restart it
when it does not).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GlooSender", "HTTPControl", "TRANSFERS", "WeightList", "address_towards",
           "check_transfer", "free_port", "gloo_group", "local_address", "open_sender"]

#: ``weight_transfer`` value -> the backend name a server is started with
TRANSFERS = {"file": "maxent_file", "gloo": "maxent_gloo", "nccl": "nccl"}


def check_transfer(kind: str, address: str | None, sender: bool) -> None:
    """The engine's ``weight_transfer`` and ``transfer_address``; for ``nccl`` on the
    sending rank, a GPU and vLLM's trainer side."""
    from maxent_grpo.validation import require

    require(kind in TRANSFERS, f"VLLMServerEngine.weight_transfer must be one of "
            f"{sorted(TRANSFERS)}; got {kind!r}")
    require(address is None or (isinstance(address, str) and address.strip() != ""),
            f"VLLMServerEngine.transfer_address must be a host name or address (or None: "
            f"found on the route to the servers); got {address!r}")
    if kind == "nccl" and sender:
        require(torch.cuda.is_available(), "VLLMServerEngine.weight_transfer 'nccl' broadcasts "
                "from rank 0's GPU and this process has none: use 'gloo' or 'file'")
        try:
            import vllm.distributed.weight_transfer.nccl_engine  # noqa: F401
        except ImportError as err:
            raise ImportError("VLLMServerEngine.weight_transfer 'nccl' drives vLLM's NCCL "
                              "backend, whose trainer side is in the vllm package: install "
                              f"vllm in the training environment ({err})") from None


def address_towards(host: str, port: int = 9) -> str:
    """This machine's IPv4 address on the route to ``host`` (a UDP socket's local end after
    ``connect``, which sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError as err:
        raise ValueError(f"VLLMServerEngine: no IPv4 route from this machine to {host!r} "
                         f"({err}); the collective transfers meet over IPv4: set "
                         "model.engine.init_args.transfer_address") from None


def local_address(urls: list[str]) -> str:
    """Where the servers reach this machine: the address of the interface on the route to
    the first server that is not on this machine, else ``127.0.0.1`` (every server local:
    a loopback name or address, ``0.0.0.0``, or a name of this machine)."""
    from urllib.parse import urlsplit

    for host in (urlsplit(u).hostname or "127.0.0.1" for u in urls):
        if host in ("localhost", "0.0.0.0", "::1") or host.startswith("127."):  # noqa: S104
            continue
        address = address_towards(host)
        if not address.startswith("127."):  # a loopback route: the host is this machine
            return address
    return "127.0.0.1"


def free_port() -> int:
    """A port of this machine nothing listens on now (the rendezvous of one server's group:
    its store listens on every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def gloo_group(address: str, port: int, rank: int, world_size: int, seconds: float) -> Any:
    """A gloo process group of its own (not torch's default group): rank 0 hosts the
    rendezvous at ``address:port``; every rank talks from its interface on the route to
    ``address`` (not the one its host name resolves to, often a loopback address) and waits
    ``seconds`` at most for the others in any operation."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=seconds)
    store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout,
                          wait_for_workers=False)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")  # the user's choice, as torch's
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])
                        if interface else dist.ProcessGroupGloo.create_device(
                            hostname=address_towards(address, port))]
    return dist.ProcessGroupGloo(dist.PrefixStore("maxent_gloo", store), rank, world_size,
                                 options)


@dataclass(frozen=True)
class ParamInfo:
    """What the receiving side allocates for one tensor (vLLM's ``ParamMeta`` fields)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class WeightList:
    """The step's weights, ``[(name, tensor)]`` on ``device``, as the weight source a
    trainer-side transfer engine reads: :meth:`metadata` first, then the pairs in the same
    order. :meth:`set` before each send, :meth:`clear` after it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.weights: list[tuple[str, torch.Tensor]] = []

    def set(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.weights = [(n, t.detach().to(self.device).contiguous()) for n, t in weights]

    def clear(self) -> None:
        self.weights = []

    def metadata(self) -> list[ParamInfo]:
        return [ParamInfo(n, t.dtype, tuple(t.shape)) for n, t in self.weights]

    def __iter__(self):
        return iter(self.weights)


class HTTPControl:
    """The four control calls a trainer-side transfer engine makes, sent to one server
    through the engine's ``_call`` (its key, its time-outs, errors as ``ServerError``).
    ``version`` is what ``finish_weight_update`` tells the server it now holds."""

    def __init__(self, engine: Any, server: Any, join_seconds: float) -> None:
        self.engine, self.server, self.join_seconds = engine, server, join_seconds
        self.version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine._call(self.server, "POST", "/init_weight_transfer_engine",
                          json={"init_info": init_info}, timeout=self.join_seconds)

    def start_weight_update(self) -> None:
        self.engine._call(self.server, "POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.engine._call(self.server, "POST", "/update_weights",
                          json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        self.engine._call(self.server, "POST", "/finish_weight_update",
                          json={"weight_version": version} if version is not None else {})


def _both(server_side, trainer_side) -> None:
    """Run ``server_side`` (an HTTP call that returns once the server's half of a collective
    is done) and ``trainer_side(failed)`` (the trainer's half, which stops early once
    ``failed()``) on two threads; return when both are done, raise as soon as either
    fails. A side still waiting in the collective is left behind (on a daemon thread, until
    the group's time-out): the group is not used again."""
    errors: list[BaseException] = []
    done = [threading.Event(), threading.Event()]

    def run(i: int, fn) -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
            errors.append(err)
        finally:
            done[i].set()

    for i, fn in enumerate((server_side, lambda: trainer_side(lambda: bool(errors)))):
        threading.Thread(target=run, args=(i, fn), daemon=True,
                         name="maxent-grpo-weights").start()
    while not errors and not all(event.wait(0.05) for event in done):
        pass
    if errors:
        raise errors[0]


class GlooSender:
    """The trainer's side of ``maxent_gloo`` (the methods of vLLM's trainer-side engines:
    ``send_weights``, ``shutdown``), built by :meth:`trainer_init`."""

    def __init__(self, client: HTTPControl, source: WeightList, group: Any) -> None:
        self.client, self.source, self.group = client, source, group

    @classmethod
    def trainer_init(cls, address: str, port: int, world_size: int, seconds: float,
                     client: HTTPControl, source: WeightList) -> GlooSender:
        box: list[Any] = []
        init = {"master_address": address, "master_port": port, "rank_offset": 1,
                "world_size": world_size, "timeout_seconds": seconds}
        _both(lambda: client.init_weight_transfer_engine(init),
              lambda failed: box.append(gloo_group(address, port, 0, world_size, seconds)))
        return cls(client, source, box[0])

    def send_weights(self) -> None:
        meta = self.source.metadata()
        info = {"names": [m.name for m in meta],
                "dtype_names": [str(m.dtype).removeprefix("torch.") for m in meta],
                "shapes": [list(m.shape) for m in meta]}
        self.client.start_weight_update()

        def broadcast(failed) -> None:
            for _, tensor in self.source:
                if failed():  # the server refused the update: nobody receives the rest
                    return
                self.group.broadcast(tensor, 0).wait()

        _both(lambda: self.client.update_weights(info), broadcast)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):  # a group whose peer died: nothing to free
                group.shutdown()


def open_sender(kind: str, engine: Any, server: Any, source: WeightList, address: str,
                seconds: float) -> tuple[Any, HTTPControl]:
    """Rendezvous with ``server`` for the collective transport ``kind`` (``"gloo"`` or
    ``"nccl"``): the trainer-side engine that sends ``source``, and its control client.
    The group is rank 0 and every worker of the server (its ``/get_world_size``: tensor- x
    pipeline- x data-parallel)."""
    workers = int(engine._call(server, "GET", "/get_world_size", timeout=30.0)["world_size"])
    port = free_port()
    client = HTTPControl(engine, server, seconds)
    if kind == "gloo":
        return GlooSender.trainer_init(address, port, 1 + workers, seconds, client,
                                       source), client
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    info = NCCLTrainerInitInfo(master_address=address, master_port=port,
                               world_size=1 + workers, rank=0)
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                        source=source), client
