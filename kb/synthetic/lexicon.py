"""Words for the synthetic generators: content vocabulary, function words, domain and
world tables, and an injective pseudo-name generator.

Content words come from the uncased BERT vocabulary that ships with the default model
(all-MiniLM-L6-v2), so every content word is a real English word and a single
word-piece; the file's sha256 goes into the manifest because the output is a pure
function of (seed, this word list, the knobs). Names are built from syllables instead,
so they split into several word-pieces the way rare real names do.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

# Glue words mixed into every text so contexts read like prose and so that a bag of
# words is dominated by uninformative tokens, as in real text.
FUNCTION_WORDS: tuple[str, ...] = tuple(
    "the of and in to a was is for on as with by at from his her their which that it an were "
    "also after during between under its has had he she they this who into over when where one "
    "two three first later both while since before against about".split()
)

# Kept out of generated text: offensive words, and contraction stems the BERT vocab
# holds as separate pieces ("couldn" from "couldn't").
_BLOCKED = frozenset(
    "fuck fucking fucked shit bitch bastard whore slut cunt dick cock pussy nigger nigga fag "
    "faggot rape raped rapist raping porn porno penis vagina nazi nazis sexual sexually nude "
    "naked dildo semen anal anus orgasm boobs tits damn hell suicide terrorist terrorism "
    "hitler holocaust genocide slave slaves slavery murder murdered murderer couldn wouldn "
    "shouldn hasn hadn didn doesn isn wasn weren aren haven mustn needn".split()
)

_WORD = re.compile(r"[a-z]{4,12}")
# The first few hundred vocabulary words are near-function words ("with", "would");
# skipping them keeps topic and signature words informative.
_SKIP_MOST_FREQUENT = 300
_MAX_CONTENT_WORDS = 14000


@dataclass(frozen=True)
class Lexicon:
    """The general content vocabulary and the fingerprint of the file it came from."""

    content: tuple[str, ...]
    source: str
    sha256: str


def load_lexicon(vocab_path: str | os.PathLike | None = None) -> Lexicon:
    """Content words from a BERT ``vocab.txt`` (default: the default model's)."""
    if vocab_path is None:
        from dist_nce.core.models import default_model_dir

        vocab_path = Path(default_model_dir()) / "vocab.txt"
    data = Path(vocab_path).read_bytes()
    words = [w for w in data.decode("utf-8").split("\n") if _WORD.fullmatch(w)]
    function = set(FUNCTION_WORDS)
    content = [w for w in words[_SKIP_MOST_FREQUENT:] if w not in _BLOCKED and w not in function]
    content = content[:_MAX_CONTENT_WORDS]
    if len(content) < 2000:
        raise ValueError(f"{vocab_path}: only {len(content)} usable content words; expected a BERT uncased vocab.txt")
    return Lexicon(tuple(content), str(vocab_path), hashlib.sha256(data).hexdigest())


@dataclass(frozen=True)
class Domain:
    """A kind of entity, which decides the disambiguating qualifier in titles.

    qualifier: current title qualifier ("footballer" -> "Name (footballer)").
    old_qualifier: what an outdated title used instead (AIDA title drift); never a
      current qualifier, so an outdated title never names another entity.
    style: "person" -> "(footballer, born 1962)" when two siblings share the domain;
      "work" -> "(1962 film)"; "plain" -> "(character II)".
    words: real English words of the domain, mixed into topic vocabularies.
    """

    qualifier: str
    old_qualifier: str
    style: str
    words: tuple[str, ...]


def _d(qualifier: str, old: str, style: str, words: str) -> Domain:
    return Domain(qualifier, old, style, tuple(words.split()))


KILT_DOMAINS: tuple[Domain, ...] = (
    _d("footballer", "soccer player", "person",
       "club league goal season striker midfielder cup match stadium transfer"),
    _d("politician", "statesman", "person",
       "party election parliament minister senate cabinet vote campaign policy"),
    _d("musician", "recording artist", "person",
       "album band song guitar tour record singer label chart concert"),
    _d("actor", "film actor", "person", "film role stage television drama theatre cast award screen series"),
    _d("cricketer", "cricket player", "person",
       "wicket innings test bowler batsman county runs over pitch captain"),
    _d("tennis player", "tennis professional", "person",
       "tournament singles doubles seed final open court serve ranking"),
    _d("boxer", "pugilist", "person", "fight title bout knockout heavyweight ring round champion punch belt"),
    _d("writer", "author", "person", "novel book poetry published fiction essay literary story prize editor"),
    _d("painter", "visual artist", "person",
       "painting canvas gallery portrait exhibition museum oil landscape art brush"),
    _d("physicist", "natural philosopher", "person",
       "theory quantum particle energy laboratory experiment physics field wave"),
    _d("businessman", "entrepreneur", "person",
       "company founder executive market shares investment board firm profit bank"),
    _d("general", "army officer", "person",
       "army battle regiment command war infantry campaign troops siege officer"),
    _d("bishop", "cleric", "person",
       "church diocese cathedral parish priest clergy synod archbishop ordained abbey"),
    _d("cyclist", "racing cyclist", "person",
       "stage tour race sprint team peloton climb jersey cycling time"),
    _d("rugby union player", "rugby footballer", "person",
       "try scrum union lock flanker tackle province fifteen cap tour"),
    _d("chess player", "chess master", "person",
       "grandmaster opening endgame rating tournament board gambit olympiad move"),
    _d("architect", "building designer", "person",
       "building design tower facade church bridge construction plan hall style"),
    _d("journalist", "reporter", "person",
       "newspaper editor column magazine report press correspondent broadcast news story"),
    _d("film", "motion picture", "work",
       "director film box office release script premiere studio sequel scene"),
    _d("album", "record", "work", "track single released producer label recording chart songs studio vinyl"),
    _d("novel", "book", "work",
       "chapter protagonist published narrative author edition plot sequel reader literary"),
    _d("ship", "vessel", "work", "hull launched navy crew tonnage harbour voyage captain sank fleet"),
)

# Entity kinds and world words for each real Zeshel world (Logeswaran et al. 2019);
# which split a world belongs to comes from kb.zeshel.ZESHEL_WORLDS.
ZESHEL_WORLD_TABLE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    name: (tuple(kinds.split(",")), tuple(words.split()))
    for name, kinds, words in (
        ("american_football", "player,coach,team,season",
         "touchdown quarterback yards draft playoff stadium defense bowl"),
        ("doctor_who", "character,episode,planet,species",
         "tardis companion regeneration alien dalek timeline series doctor"),
        ("fallout", "character,location,weapon,quest",
         "wasteland vault radiation settlement raider mutant caps shelter"),
        ("final_fantasy", "character,summon,ability,location",
         "crystal summon magic airship chocobo sword spell guardian"),
        ("military", "officer,battle,unit,aircraft",
         "regiment battalion squadron infantry artillery brigade garrison fleet"),
        ("pro_wrestling", "wrestler,event,championship,promotion",
         "ring tag title match heel feud pin submission"),
        ("starwars", "character,planet,starship,droid",
         "jedi empire rebel senate galaxy hyperspace blaster clone"),
        ("world_of_warcraft", "character,zone,quest,faction",
         "horde alliance raid dungeon guild orc paladin realm"),
        ("coronation_street", "character,episode,business,family",
         "street pub factory neighbour affair wedding cafe soap"),
        ("elder_scrolls", "character,location,spell,artifact",
         "daedra tamriel guild dragon shrine dungeon enchanted province"),
        ("ice_hockey", "player,team,arena,season",
         "puck goaltender rink defenceman playoffs trade league forward"),
        ("muppets", "character,episode,song,sketch", "puppet sketch song studio frog pig performer comedy"),
        ("forgotten_realms", "character,city,deity,spell",
         "wizard dungeon deity realm elf dwarf magic temple"),
        ("lego", "set,minifigure,theme,character", "brick minifigure theme piece model builder castle kit"),
        ("star_trek", "character,starship,species,episode",
         "starfleet captain federation warp vulcan klingon shuttle bridge"),
        ("yugioh", "card,character,deck,archetype", "duel monster spell trap deck summon attack effect"),
    )
}

# Syllables for names: ONSET+VOWEL (head) and ONSET+VOWEL+CODA (tail).
_ONSETS = ("b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p",
           "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io")
_CODAS = ("", "n", "r", "l", "s", "th", "m", "nd", "rk", "ck")
_HEAD = len(_ONSETS) * len(_VOWELS)
_TAIL = _HEAD * len(_CODAS)
WORD2 = _HEAD * _TAIL          # head+tail words ("branel")
WORD3 = _HEAD * _HEAD * _TAIL  # head+head+tail words ("tovabrand")


def _head(x: int) -> str:
    return _ONSETS[x % len(_ONSETS)] + _VOWELS[x // len(_ONSETS)]


def _tail(x: int) -> str:
    return _head(x % _HEAD) + _CODAS[x // _HEAD]


def two_word_name(x: int) -> str:
    """Injective on [0, WORD2**2): "First Last"."""
    first, last = x % WORD2, x // WORD2
    return (_head(first % _HEAD) + _tail(first // _HEAD)).capitalize() + " " + \
        (_head(last % _HEAD) + _tail(last // _HEAD)).capitalize()


def one_word_name(x: int) -> str:
    """Injective on [0, WORD3): a single three-syllable word."""
    return (_head(x % _HEAD) + _head((x // _HEAD) % _HEAD) + _tail(x // (_HEAD * _HEAD))).capitalize()


def accent(name: str, which: int) -> str:
    """Put one diacritic on ``name`` (first 'o' -> 'ö' or first 'e' -> 'é').

    Injective: generated names contain no accented letters, so the accented letter
    marks the one position that changed.
    """
    plain, marked = (("o", "ö"), ("e", "é"))[which % 2]
    return name.replace(plain, marked, 1)
