"""Code generators: the IR lowered to an executable format."""
