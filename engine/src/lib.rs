//! kvsan-engine: a GGUF Llama-family inference engine whose KV pool reports
//! every page event to kvsan's sanitizer hooks.
