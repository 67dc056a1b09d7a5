"""The lean step of tfm_numpy.fast_decode has no twin in this track: the torch searches run every cached step
through `Transformer.decode_step`. (The file is here so that the two tracks mirror each other file for file.)"""

__all__: list[str] = []
