"""Bridges from other frameworks into backplan (optional extras). Nothing inside backplan imports
this folder; the face re-exports it lazily, so a missing framework costs nothing until used."""
