"""Frame sources, the turn engine and `stream-qa` (planned: the streaming issue). Depends on `models`."""
