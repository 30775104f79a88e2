-- The render policy a dispatch's manifest pins by `policy_digest` (the settings that reach the
-- provider: sampling, tool choice, output format, client fields, cache breakpoints), kept as
-- given so GET /v1/dispatches/{id} can show it; it hashes to the manifest's policy_digest.
ALTER TABLE dispatches ADD COLUMN policy TEXT;
