"""Studies: declarative comparisons of architectures, run, analysed and reported alike.

``stats``: the additive model over a point's models and seeds, contrasts with pooled
degrees of freedom, Holm over a declared primary family, the bootstrap over documents and
seeds, and the verdict file.
"""
