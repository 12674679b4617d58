"""The reproduction of "Beyond Parameter Count: Implicit Bias in Soft Mixture of Experts" (and the router study
beside it), built on the public API of the ``softmoe`` library: one module per artefact of the papers, each returning
JSON-serializable results and rendering its report section (``report``), and the ``softmoe reproduce`` and
``softmoe report`` commands (``cli``). Nothing here plots on import; the library never imports this package."""
