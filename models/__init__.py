"""Model adapters: tiny-vlm, chat-univi, flash-vstream (planned: the models issue). Depends on `inf_mllm`."""
