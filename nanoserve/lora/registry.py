"""The engine's table of LoRA adapters (--enable-lora): which ones every rank holds, by
lora_int_id, least recently used first; at most --max-cpu-loras (default --max-loras) unless
all are in use. The engine asks it to add, remove and list adapters; the runner reads them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from nanoserve.errors import InvalidRequestError
from nanoserve.lora.adapter import LoRAError
from nanoserve.lora.request import LoRARequest


class AdapterHolder(Protocol):
    """What the registry needs of the model runner: load and drop an adapter on every rank."""

    lora: object | None  # None: the model takes no adapters (a pooling model)

    def add_lora(self, lora_int_id: int, lora_path: str) -> None: ...

    def remove_lora(self, lora_int_id: int) -> None: ...


class LoRARegistry:
    def __init__(
        self,
        holder: AdapterHolder,
        enabled: bool,
        capacity: int,
        in_use: Callable[[], set[int]],
    ) -> None:
        self.holder = holder
        self.enabled = enabled
        self.capacity = capacity  # --max-cpu-loras, else --max-loras
        self.in_use = in_use  # the adapter ids unfinished requests run with
        self.adapters: OrderedDict[int, LoRARequest] = OrderedDict()
        self.removals: set[int] = set()  # removed while requests still ran with them

    def add(self, lora: LoRARequest) -> None:
        """Make every rank hold the adapter (read from lora.lora_path the first time its id is
        seen; a bad adapter is an InvalidRequestError naming what is wrong). vLLM's add_lora."""
        if not self.enabled:
            raise InvalidRequestError(
                "LoRA is not enabled: start the engine with --enable-lora "
                "(LLM(..., enable_lora=True))"
            )
        if self.holder.lora is None:
            raise InvalidRequestError(
                "LoRA adapters are served for generating models only, not --runner pooling"
            )
        known = self.adapters.get(lora.lora_int_id)
        if known is not None:
            if (
                Path(known.lora_path).expanduser().resolve()
                != Path(lora.lora_path).expanduser().resolve()
            ):
                raise InvalidRequestError(
                    f"LoRA id {lora.lora_int_id} is already loaded from {known.lora_path!r}; "
                    f"another adapter ({lora.lora_path!r}) needs another lora_int_id"
                )
            self.adapters.move_to_end(lora.lora_int_id)
            self.removals.discard(lora.lora_int_id)
            self._trim(lora.lora_int_id, 0)
            return
        self._trim(lora.lora_int_id, 1)
        try:
            self.holder.add_lora(lora.lora_int_id, lora.lora_path)
        except LoRAError as error:
            raise InvalidRequestError(str(error)) from None
        self.adapters[lora.lora_int_id] = lora

    def _trim(self, keep: int, room: int) -> None:
        """Drop the least recently used adapters no request runs with (never `keep`) until
        `room` more fit in the capacity."""
        in_use = self.in_use() | {keep}
        victims = [i for i in self.adapters if i not in in_use]
        for victim in victims[: max(0, len(self.adapters) + room - self.capacity)]:
            self._drop(victim)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's remove_lora); False when no rank holds it. Requests still
        running with it finish with it: the ranks drop it after the last one."""
        if lora_int_id not in self.adapters or lora_int_id in self.removals:
            return False
        if lora_int_id in self.in_use():
            self.removals.add(lora_int_id)
        else:
            self._drop(lora_int_id)
        return True

    def ids(self) -> set[int]:
        """The adapters requests may name (those removed and still finishing are not)."""
        return set(self.adapters) - self.removals

    def names(self, lora_ids: set[int]) -> list[str]:
        return sorted(self.adapters[i].lora_name for i in lora_ids if i in self.adapters)

    def finish_removals(self) -> None:
        """Drop the removed adapters the last request running with has finished with."""
        if self.removals:
            for lora_int_id in self.removals - self.in_use():
                self._drop(lora_int_id)

    def _drop(self, lora_int_id: int) -> None:
        del self.adapters[lora_int_id]
        self.removals.discard(lora_int_id)
        self.holder.remove_lora(lora_int_id)
