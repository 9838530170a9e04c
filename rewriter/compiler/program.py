"""Run a rewritten layer the way its schedule says: kernels in order, each on its stream,
with the schedule's events between streams.

A ``LayerRunner`` interprets the rewritten fx graph node by node (each fused op is one
kernel launch once its CUDA kernel is registered; views cost nothing). Nodes of an aux
kernel run on the device's side stream (``aux_stream``, used only by a schedule with aux
kernels; it forks from the caller's stream and the caller's joins it only where the schedule's
events do not already order them, since each fork and join adds graph edges between layers);
before a kernel starts, its stream waits on the events the schedule recorded after the kernels
it depends on, and values made on one stream and used on another are marked for the caching
allocator. Nothing here synchronizes with the host, so a step can be captured in a CUDA graph
once every op in it is a device kernel.
On a CPU there are no streams and the graph simply runs in order.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import fx

from rewriter.compiler.rewrite import RewriteResult
from rewriter.compiler.schedule import Schedule, build_schedule

_AUX_STREAMS: dict[int, torch.cuda.Stream] = {}


def aux_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream for aux kernels, one for every runner, created outside torch's
    stream pool: a pool stream (``torch.cuda.Stream()``) is one of 32 handed out in turn, so one
    program in 32 would find its side stream to be the stream a capture runs on (vLLM's capture
    stream comes from the same pool) and lose its overlap."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _AUX_STREAMS:
        from cuda.bindings import runtime

        with torch.cuda.device(index):
            status, handle = runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking)
        if status != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaStreamCreateWithFlags failed: {status}")
        _AUX_STREAMS[index] = torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", index))
    return _AUX_STREAMS[index]


class LayerRunner(fx.Interpreter):
    def __init__(self, result: RewriteResult, schedule: Schedule, device: torch.device | str = "cpu"):
        super().__init__(result.after.gm)
        self.schedule = schedule
        self.device = torch.device(device)
        self.kernel_of: dict[str, str] = {n: k.name for k in schedule.kernels for n in k.nodes}
        self.stream_name = {k.name: k.stream for k in schedule.kernels}
        self.waits: dict[str, list[str]] = defaultdict(list)  # kernel -> kernels whose end it waits for
        for e in schedule.events:
            self.waits[e.before].append(e.record_after)
        self.recorded = {e.record_after for e in schedule.events}
        self.last_node = {k.name: k.nodes[-1] for k in schedule.kernels}
        aux = [k.name for k in schedule.kernels if k.stream == "aux"]
        waited_by_main = {src for k, srcs in self.waits.items() if self.stream_name[k] == "main" for src in srcs}
        # the aux stream forks from the caller's stream at the start unless its first kernel waits on a main
        # kernel of the layer (which comes after the caller's work), and the caller's stream joins it at the end
        # unless a main kernel already waits on its last kernel: edges that say nothing new are not added
        self.fork = bool(aux) and not self.waits.get(aux[0])
        self.join = bool(aux) and aux[-1] not in waited_by_main
        self.streams: dict[str, Any] = {}
        if self.device.type == "cuda":  # a side stream only where the schedule puts a kernel on it
            self.streams = {"main": None}
            if aux:
                self.streams["aux"] = aux_stream(self.device)
        self._events: dict[str, torch.cuda.Event] = {}
        self._started: set[str] = set()
        self._made_on: dict[str, str] = {}

    @classmethod
    def of(cls, result: RewriteResult, device: torch.device | str = "cpu") -> LayerRunner:
        """The runner of ``result`` on its own schedule."""
        return cls(result, build_schedule(result.after), device=device)

    def __call__(self, *inputs: Any) -> Any:
        return self.run(*inputs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self._events, self._started, self._made_on = {}, set(), {}
        aux = self.streams.get("aux")
        if self.streams:
            self.streams["main"] = torch.cuda.current_stream(self.device)
        if aux is not None and self.fork:
            aux.wait_stream(self.streams["main"])  # inputs were made on the caller's stream
        out = super().run(*args, **kwargs)
        if aux is not None and self.join:  # the caller's stream sees everything the aux stream did
            self.streams["main"].wait_stream(aux)
        return out

    def run_node(self, n: fx.Node) -> Any:
        kernel = self.kernel_of.get(n.name)
        if not self.streams:
            return super().run_node(n)
        if kernel is None:  # a view: it lives where its source was made
            source = next((self._made_on[a.name] for a in n.all_input_nodes if a.name in self._made_on), None)
            if source is not None:
                self._made_on[n.name] = source
            return super().run_node(n)
        stream_name = self.stream_name[kernel]
        stream = self.streams[stream_name]
        if kernel not in self._started:
            self._started.add(kernel)
            for src in self.waits.get(kernel, ()):
                stream.wait_event(self._events[src])
        with torch.cuda.stream(stream):
            for a in n.all_input_nodes:  # values from another stream: keep their memory alive here
                made = self._made_on.get(a.name)
                value = self.env.get(a)
                if made is not None and made != stream_name and isinstance(value, torch.Tensor):
                    value.record_stream(stream)
            result = super().run_node(n)
        self._made_on[n.name] = stream_name
        if kernel in self.recorded and self.last_node[kernel] == n.name:
            event = torch.cuda.Event()
            event.record(stream)
            self._events[kernel] = event
        return result
