"""The error of an impossible or inconsistent layout (re-exported as ``autoshard.LayoutError``).

Example::

    >>> raise LayoutError("layout names dim 'vocab', which no tensor has")  # doctest: +SKIP
"""


class LayoutError(ValueError):
    """An impossible or inconsistent layout: unknown names, indivisible sizes, one mesh axis on
    two dims of one tensor."""
