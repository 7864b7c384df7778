"""Interactive widgets (ipywidgets), one module per chapter.

Every widget has a static figure beside it in its chapter, for readers without
a live kernel (a static book site, a notebook viewer).
"""
