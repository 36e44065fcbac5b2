"""CUDA streams and events as inert stand-ins, for running frameworks' own code on fake CPU
tensors (megatron's MoE dispatcher and offloading, torchtune's activation offloading). They
order work on a device; on the fake device everything has already happened, so none of them
changes what memory is alive."""

from __future__ import annotations


class Event:
    """torch.cuda.Event stand-in."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Stream:
    """torch.cuda.Stream stand-in."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> Event:
        return event if event is not None else Event()

    def synchronize(self) -> None:
        pass
