"""One module per artefact of the papers; each returns JSON-serializable results and never plots on import."""
