"""The REST resources of SPEC 15, one module each: they parse, check the token's scope and
call the admin layer; the SQL (and its tenant scoping) lives there."""
