"""Generation: sampling, the cached decoding loop (decoder-only and encoder-decoder, with a KV cache,
recurrent state or both) and speculative decoding. Everything that turns prompts into new tokens lives here."""
