"""Chat-UniVi ported onto the streaming core: DPC-KNN token merging, CLIP tower, Vicuna LLM (and a tiny CPU variant)."""
