"""A worker serving LoRA adapters through ``warmgate.worker``'s runtime
LoRA routes: ``POST /v1/chat/completions`` answers with the model it
served and the adapters loaded, and, as vLLM, 404 for a model that is
neither the base nor a loaded adapter."""

from typing import Any, Optional, Tuple

from warmgate.worker import Worker


class AdapterWorker(Worker):
    def handle(self, method: str, path: str, payload: Any) -> Optional[Tuple[int, Any]]:
        if method == "POST" and path == "/v1/chat/completions":
            model = (payload or {}).get("model")
            if model != "base" and model not in self.adapters:
                return 404, {"error": {"message": f"The model `{model}` does not exist.",
                                       "type": "NotFoundError", "code": 404}}
            return 200, {"model": model, "loaded": sorted(self.adapters)}
        return None


if __name__ == "__main__":
    AdapterWorker().serve()
