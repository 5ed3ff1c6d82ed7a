"""Generation: sampling, the KV-cached decoding loop (decoder-only and encoder-decoder) and the
recurrent encoder-decoder loop. Everything that turns prompts into new tokens lives here."""
