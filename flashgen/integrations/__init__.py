"""Bridges from other libraries' attention hooks to flashgen (imported on demand, never by
`import flashgen`)."""
