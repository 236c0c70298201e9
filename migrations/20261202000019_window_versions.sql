-- Each changed key of a window now carries the version live at the window's end, found once
-- when the window is cut, so a page reads it by id instead of searching the key's versions.
-- Windows cut before this migration have none; their pages search as before.
ALTER TABLE feed_window_keys ADD COLUMN version_id bigint;

-- Checking the window of each of a million keys cost more than writing them (2.7 of 4.4 s):
-- keys are written only with their window, in its transaction, and history collection deletes
-- a window's keys with it.
ALTER TABLE feed_window_keys DROP CONSTRAINT feed_window_keys_window;
