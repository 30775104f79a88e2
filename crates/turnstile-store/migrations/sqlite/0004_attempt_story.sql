-- Each attempt's recovery spending and its story, durable so they hold across restarts and
-- replicas: resumes and replays made of it (the per-generation budgets every driver reads),
-- why it stopped (`end_reason`, the latest cause: stream_cut, head_timeout, resume_refused,
-- provider_status_503, committed, …) and how its end was confirmed before a new generation
-- (`confirmed_over`: lease_expired by the store's clock, or provider_ended).
ALTER TABLE attempts ADD COLUMN resumes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN replays INTEGER NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN end_reason TEXT;
ALTER TABLE attempts ADD COLUMN confirmed_over TEXT;
