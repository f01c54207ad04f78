"""Tool calls: a request's tools read and bounded (``request``), shown to the model in its chat
template (``prompt``), its calls constrained by a grammar (``grammar``), parsed from the text the
model writes in its own format (``parsers``) and answered as the door's tool calls (``answer``);
``use`` puts these together for a door."""
