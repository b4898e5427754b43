"""Sections of the dashboard's one page, one module each: `layout(...) -> Component`.

One scrolling page (not Dash Pages) so a single load shows every view: what a performance
engineer reads top to bottom, and what the render benchmark and the screenshot measure.
"""
