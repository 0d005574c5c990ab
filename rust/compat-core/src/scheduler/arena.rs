//! The live requests: a slot arena with generations, plus the caller's string ids.
use std::collections::HashMap;

use super::request::{Request, RequestId};

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    request: Option<Request>,
}

/// Owns every live request. Removing one frees its slot for reuse and bumps the
/// generation, so stale [`RequestId`]s stop resolving.
#[derive(Debug, Default)]
pub(super) struct Requests {
    slots: Vec<Slot>,
    free: Vec<u32>,
    by_external: HashMap<String, RequestId>,
}

impl Requests {
    pub fn len(&self) -> usize {
        self.by_external.len()
    }

    pub fn lookup(&self, external_id: &str) -> Option<RequestId> {
        self.by_external.get(external_id).copied()
    }

    pub fn contains_external(&self, external_id: &str) -> bool {
        self.by_external.contains_key(external_id)
    }

    /// Stores `request`; the caller has checked its external id is not in use.
    pub fn insert(&mut self, request: Request) -> RequestId {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot::default());
            u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 live requests")
        });
        let entry = &mut self.slots[slot as usize];
        debug_assert!(entry.request.is_none(), "free slot {slot} is occupied");
        let id = RequestId::new(slot, entry.generation);
        let previous = self.by_external.insert(request.external_id.clone(), id);
        debug_assert!(previous.is_none(), "duplicate external id");
        entry.request = Some(request);
        id
    }

    pub fn get(&self, id: RequestId) -> Option<&Request> {
        let slot = self.slots.get(id.slot())?;
        (slot.generation == id.generation())
            .then_some(slot.request.as_ref())
            .flatten()
    }

    pub fn get_mut(&mut self, id: RequestId) -> Option<&mut Request> {
        let slot = self.slots.get_mut(id.slot())?;
        if slot.generation == id.generation() {
            slot.request.as_mut()
        } else {
            None
        }
    }

    /// Forgets a request and returns it.
    pub fn remove(&mut self, id: RequestId) -> Option<Request> {
        let slot = self.slots.get_mut(id.slot())?;
        if slot.generation != id.generation() {
            return None;
        }
        let request = slot.request.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(id.slot() as u32);
        let removed = self.by_external.remove(&request.external_id);
        debug_assert_eq!(removed, Some(id), "external id map out of sync");
        Some(request)
    }

    pub fn iter(&self) -> impl Iterator<Item = (RequestId, &Request)> {
        self.slots.iter().enumerate().filter_map(|(slot, entry)| {
            let request = entry.request.as_ref()?;
            Some((RequestId::new(slot as u32, entry.generation), request))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(name: &str) -> Request {
        Request::new(name.into(), 1, 1, Box::new([]), 0)
    }

    #[test]
    fn stale_ids_do_not_resolve_after_slot_reuse() {
        let mut arena = Requests::default();
        let a = arena.insert(request("a"));
        assert_eq!(arena.lookup("a"), Some(a));
        assert_eq!(arena.remove(a).unwrap().external_id, "a");
        let b = arena.insert(request("b"));
        assert_eq!(a.slot(), b.slot(), "the slot is reused");
        assert!(arena.get(a).is_none());
        assert!(arena.remove(a).is_none());
        assert_eq!(arena.get(b).unwrap().external_id, "b");
        assert_eq!(arena.lookup("a"), None);
        assert_eq!(arena.len(), 1);
    }

    #[test]
    fn iter_lists_live_requests_only() {
        let mut arena = Requests::default();
        let ids: Vec<_> = ["a", "b", "c"].map(|n| arena.insert(request(n))).into();
        arena.remove(ids[1]);
        let live: Vec<_> = arena
            .iter()
            .map(|(id, r)| (id, r.external_id.as_str()))
            .collect();
        assert_eq!(live, vec![(ids[0], "a"), (ids[2], "c")]);
    }
}
