"""The names a server answers to (vLLM's `OpenAIServingModels`): the base model's (--served-model-name) and its
LoRA adapters', from --lora-modules at start and from /v1/load_lora_adapter at runtime. A request's `model`
picks the base model or one adapter; an adapter is a `LoRARequest` under a fresh id each time it is loaded, so
that an adapter unloaded and loaded again from another folder never meets the old one's slot or cached blocks.

An adapter is read and checked by the engine when it is loaded (a missing file, a rank over --max-lora-rank, a
shape not the base model's: a 400), not at its first request."""

from __future__ import annotations

import itertools

from heron.engine.async_llm import AsyncLLM
from heron.entrypoints.openai.errors import ApiError
from heron.entrypoints.openai.protocol import ModelCard, RequestModel
from heron.lora_request import LoRARequest


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter's body (vLLM's); `load_inplace` replaces an adapter of that name."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str


class OpenAIServingModels:
    def __init__(self, engine: AsyncLLM, base_model_names: list[str]) -> None:
        self.engine = engine
        self.base_model_names = base_model_names
        self.lora_requests: dict[str, LoRARequest] = {}  # name -> adapter, in loading order
        self.parents: dict[str, str] = {}  # adapter name -> its base model's name
        self._loading: set[str] = set()  # names being read by the engine now
        self._ids = itertools.count(1)

    def model_name(self, asked: str | None) -> str:
        """The name to report for a request; 404 for a name this server does not serve."""
        if asked is None:
            return self.base_model_names[0]
        if asked not in self.base_model_names and asked not in self.lora_requests:
            raise ApiError(404, f"The model `{asked}` does not exist.", param="model", code="model_not_found")
        return asked

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter a request's (checked) model name picks; None: the base model."""
        return self.lora_requests.get(name)

    def cards(self, root: str, created: int, max_model_len: int) -> list[ModelCard]:
        """The base model's names (root: its folder or hub id), then each adapter (id: its name, root: its
        folder, parent: its base model's name), as vLLM lists them."""
        common = dict(created=created, max_model_len=max_model_len)
        base = [ModelCard(id=name, root=root, **common) for name in self.base_model_names]
        loras = [
            ModelCard(id=n, root=lora.lora_path, parent=self.parents[n], **common)
            for n, lora in self.lora_requests.items()
        ]
        return base + loras

    async def load_lora_adapter(
        self, name: str, path: str, base_model_name: str | None = None, load_inplace: bool = False
    ) -> str:
        """Read and check the adapter at `path` in the engine, then serve it as `name` (replacing the adapter of
        that name with `load_inplace`); a 400 when the name is taken or the adapter is bad (the server serves on)."""
        if not name or not path:
            param = "lora_path" if name else "lora_name"
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", param=param)
        taken = name in self._loading or name in self.base_model_names
        if taken or (name in self.lora_requests and not load_inplace):
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        lora = LoRARequest(name, next(self._ids), path)
        self._loading.add(name)
        try:
            await self.engine.add_lora(lora)
        except ValueError as e:
            raise ApiError(400, f"Failed to load LoRA adapter '{name}': {e}", param="lora_path") from None
        finally:
            self._loading.discard(name)
        if (old := self.lora_requests.pop(name, None)) is not None:
            self.engine.remove_lora(old.lora_int_id)
        self.lora_requests[name] = lora
        self.parents[name] = base_model_name or self.base_model_names[0]
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, name: str) -> str:
        """Stop serving `name` (a 404 for a name not loaded); requests already running with it finish."""
        lora = self.lora_requests.pop(name, None)
        if lora is None:
            raise ApiError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found"
            )
        del self.parents[name]
        self.engine.remove_lora(lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."
