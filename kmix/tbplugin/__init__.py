"""The "Mixed Precision" TensorBoard tab (plugin ``kmix``), shipped inside kmix.

TensorBoard finds :class:`kmix.tbplugin.plugin.KmixPlugin` through the
``tensorboard_plugins`` entry point: ``tensorboard --logdir runs`` shows the tab
whenever a run holds ``kmix/`` tags. Modules:

* :mod:`~kmix.tbplugin.reader`: kmix points of a run from TensorBoard's data provider;
* :mod:`~kmix.tbplugin.view`: the JSON the page draws (the report's summary, findings
  and events, downsampled series, exponent heatmaps);
* :mod:`~kmix.tbplugin.float8`: the Float8 section's JSON (headroom grid, episodes);
* :mod:`~kmix.tbplugin.plugin`: the routes;
* ``static/``: the page (an ES module, its HTML and CSS; hand-written SVG charts).
"""
