"""Checkpoint loading with expert sharding: every rank reads only the tensors it will hold.

load_model_weights(source, config, placement, rank, ...)   canonical weights for one rank
SafetensorsDir(path)      a Hugging Face checkpoint dir (config.json + memory-mapped shards)
GGUFFile(path)            a GGUF file (the `gguf` package; dequantized on read)
convert_gguf(path)        GGUF -> cached HF-style dir (fast memory-mapped loads afterwards)
expert_layout(E, W, topo)  which rank hosts which expert (the topology's, or contiguous)
random_weights(config, ...)  random weights of a named config, local experts only
Tokenizer                 tokenizer.json (+ chat template) via `tokenizers`
"""
